package fuse

// The kernel-cached mode (--kernel-cache on): the kernel caches the
// export's pages, reads ahead and batches buffered writes (writeback
// cache); we keep it coherent with what changes the image behind it
// (docs/design.md, The kernel cache). Notifies never run in a serve loop
// (the kernel may write dirty pages back to us first) and run on a thread
// of their own (kernelcalls_linux.go).

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// notifyInvalInode is FUSE_NOTIFY_INVAL_INODE's code in the out header's
// error field of an unsolicited message (unique 0).
const notifyInvalInode = 2

// notifyInval drops the kernel's cached pages of [off, off+length) of the
// export's file (length 0: to the end) and its cached attributes. The
// kernel answers ENOENT when it does not know the inode (nothing cached).
func (s *server) notifyInval(off, length int64) error {
	msg := struct {
		h fuse.OutHeader
		n fuse.NotifyInvalInodeOut
	}{}
	msg.h = fuse.OutHeader{Length: uint32(unsafe.Sizeof(msg)), Status: notifyInvalInode}
	msg.n = fuse.NotifyInvalInodeOut{Ino: s.exp.ino, Off: off, Length: length}
	b := unsafe.Slice((*byte)(unsafe.Pointer(&msg)), unsafe.Sizeof(msg))
	if err := s.calls.onNotify(func() error { return s.notify(b) }); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("FUSE_NOTIFY_INVAL_INODE [%d, +%d): %w", off, length, err)
	}
	return nil
}

// notify writes an unsolicited message (unique 0) on the connection.
func (s *server) notify(msg []byte) error {
	for {
		if _, err := unix.Write(s.fds[0], msg); !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// handOffOnly says whether req must run outside the serve loop even when
// the loop is alone: a write whose reply may wait for an invalidation.
func (s *server) handOffOnly(req []byte) bool {
	return header(req).Opcode == opWrite && s.exp.WriteBypassesCache(decode[fuse.WriteIn](req))
}

// kernelSize is the export file's size as the kernel caches it (under
// the writeback cache, its own i_size), asked without a GETATTR
// (AT_STATX_DONT_SYNC); ok false when it cannot be had.
func kernelSize(file string) (int64, bool) {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, file, unix.AT_STATX_DONT_SYNC, unix.STATX_SIZE, &stx); err != nil || stx.Mask&unix.STATX_SIZE == 0 {
		return 0, false
	}
	return int64(stx.Size), true
}

// MinReadAheadKB is the least read-ahead window of a kernel-cached
// export: 1 MiB, one maximal READ ahead of a sequential reader.
const MinReadAheadKB = maxWrite / 1024

// DeviceReadAheadKB is the read-ahead window of the block device that
// holds path's file system (sysfs, by the file's st_dev: the disk's own
// bdi, or a partition's disk's); ok false where there is none (a URL, a
// file system without a block device).
func DeviceReadAheadKB(path string) (int, bool) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, false
	}
	dev := fmt.Sprintf("%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	for _, p := range []string{
		filepath.Join("/sys/dev/block", dev, "bdi", "read_ahead_kb"),
		filepath.Join("/sys/dev/block", dev, "..", "bdi", "read_ahead_kb"), // a partition
		filepath.Join("/sys/class/bdi", dev, "read_ahead_kb"),
	} {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		if kb, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && kb > 0 {
			return kb, true
		}
	}
	return 0, false
}

// tuneBDI sets the export's bdi for the kernel cache: read_ahead_kb to raKB
// (0: MinReadAheadKB; INIT can only lower the 128 KiB default), and
// strict_limit and max_ratio 1 (FUSE's defaults, should a distribution
// loosen them), so that a loop device over the export cannot deadlock on
// its dirty pages (docs/design.md, The kernel cache).
func tuneBDI(dev uint64, raKB int) error {
	if raKB <= 0 {
		raKB = MinReadAheadKB
	}
	dir := filepath.Join("/sys/class/bdi", fmt.Sprintf("%d:%d", unix.Major(dev), unix.Minor(dev)))
	set := []struct{ name, val string }{
		{"read_ahead_kb", strconv.Itoa(raKB)},
		{"strict_limit", "1"},
		{"max_ratio", "1"},
	}
	var errs []error
	for _, kv := range set {
		if err := os.WriteFile(filepath.Join(dir, kv.name), []byte(kv.val), 0); err != nil {
			errs = append(errs, fmt.Errorf("bdi %s: %w", kv.name, err))
		}
	}
	return errors.Join(errs...)
}

// notifyStore is FUSE_NOTIFY_STORE's code: data for the kernel's page
// cache of an inode, which also extends its i_size to the data's end.
const notifyStore = 4

// presetSize gives a writeback-cached kernel the file's size before any
// client can look (the kernel then ignores GETATTR's size, and made the
// root inode before INIT with size 0): nothing but INIT is answered yet.
// It stores the image's last page, since the kernel grows i_size to a
// stored range's end only for a range of at least one byte. ok false: the
// caller falls back to learnSize.
func (s *server) presetSize(ctx context.Context) (ok bool, err error) {
	if !s.writebackCache() {
		return true, nil
	}
	size := s.exp.img.Size()
	if size <= 0 {
		return true, nil
	}
	page := int64(unix.Getpagesize())
	start := (size - 1) &^ (page - 1)
	data := make([]byte, size-start)
	if _, err := s.exp.img.ReadAt(ctx, data, start); err != nil {
		return false, fmt.Errorf("kernel cache: reading the last page for the kernel's size: %w", err)
	}
	msg := make([]byte, int(unsafe.Sizeof(fuse.OutHeader{}))+int(unsafe.Sizeof(fuse.NotifyStoreOut{}))+len(data))
	h := (*fuse.OutHeader)(unsafe.Pointer(&msg[0]))
	*h = fuse.OutHeader{Length: uint32(len(msg)), Status: notifyStore}
	n := (*fuse.NotifyStoreOut)(unsafe.Pointer(&msg[unsafe.Sizeof(fuse.OutHeader{})]))
	*n = fuse.NotifyStoreOut{Nodeid: s.exp.ino, Offset: uint64(start), Size: uint32(len(data))}
	copy(msg[unsafe.Sizeof(fuse.OutHeader{})+unsafe.Sizeof(fuse.NotifyStoreOut{}):], data)
	// ENOENT: the kernel has no such inode yet (the file in a --file-name
	// directory): its LOOKUP will carry the size.
	if err := s.notify(msg); err != nil && !errors.Is(err, unix.ENOENT) {
		return false, fmt.Errorf("kernel cache: FUSE_NOTIFY_STORE of the last page: %w", err)
	}
	return true, nil
}

// learnSize is presetSize's fallback once the loops run: SETATTR's reply
// is the one the kernel takes i_size from, so the file is truncated to its
// own size (SetAttr resizes nothing) before Mount returns.
func (s *server) learnSize(file string) error {
	if !s.writebackCache() {
		return nil
	}
	if err := unix.Truncate(file, s.exp.img.Size()); err != nil {
		return fmt.Errorf("kernel cache: setting the size the kernel caches: %w", err)
	}
	return nil
}

// flushKernelCache writes the kernel's dirty pages of the export back to us
// and makes them durable before Unmount unmounts (or detaches and aborts,
// which would drop them). From the moment the export is closing GETATTR
// fails, so a buffered write not yet begun fails too; the fsync takes the
// inode lock, so it waits for one under way and writes it back. Whatever
// write returned before the fsync is in the image; any later one failed.
func (s *server) flushKernelCache(file string) error {
	return s.calls.onOther(func() error {
		// Open first: with the attributes invalid, the permission check
		// of an open would need the GETATTR that closing refuses.
		fd, err := unix.Open(file, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return fmt.Errorf("opening the export to flush it: %w", err)
		}
		defer unix.Close(fd)
		s.exp.closing.Store(true)
		if err := s.notifyInval(-1, 0); err != nil {
			return err
		}
		if err := unix.Fsync(fd); err != nil {
			return fmt.Errorf("fsync of the export: %w", err)
		}
		return nil
	})
}

// writebackCache says whether the kernel caches our writes.
func (s *server) writebackCache() bool { return s.negotiated&fuse.CAP_WRITEBACK_CACHE != 0 }

// mendFailedWriteback runs after the reply to a write-back WRITE that
// failed or fell short for [off, off+length): the kernel keeps the error
// for fsync/close but holds the pages as written (and, past the end of a
// non-growable image, a size we lack). It drops them and hands the size
// back with a SETATTR (see learnSize). Not before the reply: both wait for
// the write-back the reply ends.
func (s *server) mendFailedWriteback(file string, off, length int64) {
	if err := s.notifyInval(off, length); err != nil {
		s.exp.log.Warn("cannot drop pages whose write-back failed", "err", err)
	}
	err := s.calls.onOther(func() error { return unix.Truncate(file, s.exp.img.Size()) })
	if err != nil && !errors.Is(err, unix.ENOTCONN) {
		s.exp.log.Warn("cannot give the kernel the image's size back after a failed write-back", "err", err)
	}
}
