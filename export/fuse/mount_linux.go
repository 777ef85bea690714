package fuse

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
)

// AllowOther is the --allow-other policy.
type AllowOther string

const (
	AllowOtherAuto AllowOther = "auto" // try allow_other, fall back without
	AllowOtherOn   AllowOther = "on"
	AllowOtherOff  AllowOther = "off"
)

// ParseAllowOther checks an --allow-other value.
func ParseAllowOther(s string) (AllowOther, error) {
	switch AllowOther(s) {
	case AllowOtherAuto, AllowOtherOn, AllowOtherOff:
		return AllowOther(s), nil
	}
	return "", fmt.Errorf("unknown --allow-other value %q (want auto, on or off)", s)
}

// MountOptions say how to mount an export.
type MountOptions struct {
	AllowOther AllowOther
	// FsName is the "device" column of /proc/mounts (the image spec).
	FsName string
	// Queues is the number of /dev/fuse queues, each served by its own
	// thread (FUSE_DEV_IOC_CLONE); 0 or 1 means one.
	Queues int
	// PollFor > 0 busy-polls each queue that long after a request before
	// sleeping: lower latency at queue depth 1, one core kept busy.
	PollFor time.Duration
	// NoPace turns off the short spin for the next request of a reader
	// that waits on each reply (see depthGuess).
	NoPace bool
	// ParkIdle > 0: a queue that had no request for that long waits for
	// the next in Go's netpoller rather than in read(2), which holds an OS
	// thread (its stacks) per idle export: a daemon's many exports. Until
	// then its loop sleeps in poll(2) as in read(2), at the cost of one
	// more system call (the read that finds nothing) per sleep. Not with
	// PollFor, nor for a queue that reads completions (they poll already).
	ParkIdle time.Duration
	Stats    *Stats // when set, counts every request (--stats)
	// FileName, when set, makes the mountpoint an existing directory and
	// the export the one file of that name in it (see CheckFileName).
	FileName string
	// Extra are the partitions, beside FileName (dir_linux.go).
	Extra []ExtraFile
}

// Mount is a mounted, serving export.
type Mount struct {
	path   string    // the mountpoint
	file   string    // the exported file: path, or path/FileName
	made   *madeFile // the mountpoint file we created, removed at the end; nil if none
	conn   uint64    // fusectl connection number, for aborting
	served chan struct{}
	log    *slog.Logger
	// oneLoop: the one queue's loop also reads the image's completions
	// (see ReadsCompletions).
	oneLoop bool
	// flushCache, with the kernel cache on, writes the kernel's dirty
	// pages of the export back to us before Unmount lets go of it.
	flushCache func() error
	// unmounted: Unmount's unmount(2) succeeded, so the connection's end
	// needs no look at the mount table (see serve).
	unmounted atomic.Bool
}

// ReadsCompletions says whether one loop serves /dev/fuse and reads the
// image's completions too (an NBD source, one /dev/fuse queue): see
// OneProcForOneLoop.
func (m *Mount) ReadsCompletions() bool { return m.oneLoop }

// ErrMountpoint marks problems with the mountpoint the user gave.
var ErrMountpoint = errors.New("bad mountpoint")

// madeFile is a mountpoint file we created: its path and the identity
// (device and inode) of the file we created there.
type madeFile struct {
	path     string
	dev, ino uint64
}

// remove unlinks the file if path still names the inode we created: once
// unmounted, someone may have replaced it (renamed another file over it),
// and theirs is not ours to delete.
func (f *madeFile) remove() error {
	if f == nil {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Lstat(f.path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("stat %s: %w", f.path, err)
	}
	if st.Dev != f.dev || st.Ino != f.ino {
		return fmt.Errorf("%s is no longer the file we created (another file was put in its place); left as it is", f.path)
	}
	if err := os.Remove(f.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// prepareMountpoint checks path is usable and creates it when missing (a
// file; a directory, for dir, must exist). It returns the absolute path and
// the file it created (nil if none).
func prepareMountpoint(path string, dir bool) (string, *madeFile, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", nil, fmt.Errorf("mountpoint %s: %w", path, err)
	}
	st, err := os.Stat(abs)
	if dir {
		switch {
		case err != nil:
			return "", nil, fmt.Errorf("%w: with --file-name the mountpoint is an existing directory: %v", ErrMountpoint, err)
		case !st.IsDir():
			return "", nil, fmt.Errorf("%w: with --file-name the mountpoint must be a directory; %s is not", ErrMountpoint, abs)
		}
		return checkNotMounted(abs)
	}
	if errors.Is(err, fs.ErrNotExist) {
		fd, err := unix.Open(abs, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return "", nil, fmt.Errorf("%w: cannot create %s: %v", ErrMountpoint, abs, err)
		}
		defer unix.Close(fd)
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			os.Remove(abs)
			return "", nil, fmt.Errorf("%w: stat of the created %s: %v", ErrMountpoint, abs, err)
		}
		return abs, &madeFile{path: abs, dev: st.Dev, ino: st.Ino}, nil
	}
	if err != nil {
		return "", nil, fmt.Errorf("%w: %v", ErrMountpoint, err)
	}
	if st.IsDir() {
		return "", nil, fmt.Errorf("%w: %s is a directory; the mountpoint must be a regular file (or pass --file-name NAME to export DIR/NAME)", ErrMountpoint, abs)
	}
	if !st.Mode().IsRegular() {
		return "", nil, fmt.Errorf("%w: %s is not a regular file", ErrMountpoint, abs)
	}
	return checkNotMounted(abs)
}

// checkNotMounted resolves abs and refuses it when a FUSE export is
// mounted there already.
func checkNotMounted(abs string) (string, *madeFile, error) {
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return "", nil, fmt.Errorf("%w: %v", ErrMountpoint, err)
	}
	if mountPoint(real) && fuseMounted(real) {
		return "", nil, fmt.Errorf("%w: there already is a FUSE export on %s", ErrMountpoint, real)
	}
	return real, nil, nil
}

// mountPoint says whether something may be mounted on path: it is on
// another device than its directory. Only then is the mount table read:
// reading it costs about 1 ms per 200 mounts (2 ms parsed), which each
// export added to a daemon holding many paid.
func mountPoint(path string) bool {
	var st, parent unix.Stat_t
	if unix.Stat(path, &st) != nil || unix.Stat(filepath.Dir(path), &parent) != nil {
		return true // unsure: let the mount table say
	}
	return st.Dev != parent.Dev
}

// fuseMounted says whether path is the mount point of a FUSE file system.
func fuseMounted(path string) bool {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// id parent major:minor root mountpoint opts... - fstype source superopts
		fields := strings.Fields(sc.Text())
		sep := slices.Index(fields, "-")
		if len(fields) < 5 || sep < 0 || sep+1 >= len(fields) {
			continue
		}
		if fstype := fields[sep+1]; unescapeMountinfo(fields[4]) == path && (fstype == "fuse" || strings.HasPrefix(fstype, "fuse.")) {
			return true
		}
	}
	return false
}

// unescapeMountinfo undoes the kernel's octal escapes (\040 for a space).
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Mount mounts exp on path (a regular file, created if missing) and starts
// serving it. The image must already be open: when path is the image itself,
// the export shadows it and the original reappears on unmount.
func (exp *Export) Mount(path string, o MountOptions) (*Mount, error) {
	dir := o.FileName != ""
	if dir {
		if err := CheckFileName(o.FileName); err != nil {
			return nil, err
		}
	}
	abs, made, err := prepareMountpoint(path, dir)
	if err != nil {
		return nil, err
	}
	fd, err := exp.mountAllowOther(abs, o, dir)
	if err != nil {
		made.remove()
		return nil, fmt.Errorf("mount %s: %w", abs, err)
	}
	srv := newServer(exp, fd)
	file := abs
	if dir {
		srv.fileName = o.FileName
		exp.ino = fileIno
		file = filepath.Join(abs, o.FileName)
	}
	sizeKnown, err := false, srv.addExtraFiles(o.Extra)
	if err == nil {
		sizeKnown, err = srv.start(o)
	}
	if err != nil {
		// The queues' fds first: a setup that failed for want of
		// descriptors (cloning --queues) left none for detach, whose
		// look at the mount table then failed and read as "not
		// mounted", and the dead mount stayed.
		for _, fd := range srv.fds {
			unix.Close(fd)
		}
		detach(abs, exp.log)
		made.remove()
		return nil, fmt.Errorf("mount %s: %w", abs, err)
	}
	m := &Mount{path: abs, file: file, made: made, served: make(chan struct{}), log: exp.log, oneLoop: srv.comp != nil}
	srv.wireKernelCache(m)
	go m.serve(srv)
	// Only now: a stat of our own mount needs the loops to answer it.
	var st unix.Stat_t
	if err := unix.Stat(abs, &st); err == nil {
		m.conn = uint64(unix.Major(st.Dev))<<20 | uint64(unix.Minor(st.Dev))
		if exp.opts.KernelCache {
			if err := tuneBDI(st.Dev, exp.opts.ReadAheadKB); err != nil {
				exp.log.Info("kernel cache: the export's bdi keeps the kernel's defaults", "why", err)
			}
		}
	}
	if sizeKnown {
		return m, nil
	}
	if err := srv.learnSize(file); err != nil {
		m.Unmount()
		made.remove()
		return nil, fmt.Errorf("mount %s: %w", abs, err)
	}
	return m, nil
}

// mountAllowOther mounts abs with allow_other as o asks, and in auto mode
// without it when that is refused, and returns the /dev/fuse descriptor.
func (exp *Export) mountAllowOther(abs string, o MountOptions, dir bool) (int, error) {
	var firstErr, err error
	tries := []bool{o.AllowOther != AllowOtherOff}
	if o.AllowOther == AllowOtherAuto {
		tries = append(tries, false)
	}
	for i, ao := range tries {
		var fd int
		fd, err = mountFUSE(abs, o.FsName, exp.opts.Writable, ao, dir)
		if err == nil {
			exp.allowOther.Store(ao)
			if i > 0 {
				exp.log.Info("allow_other refused; mounted without it, so only this user can open the export (an unprivileged user needs user_allow_other in /etc/fuse.conf)", "why", firstErr)
			}
			return fd, nil
		}
		if i == 0 {
			firstErr = err
		}
		exp.log.Debug("mount attempt failed", "allow_other", ao, "err", err)
	}
	return -1, err
}

// start brings the connection up to serving: INIT, the size under the
// kernel cache (sizeKnown false: learnSize must tell it once the loops
// run), the queues and how they wait.
func (s *server) start(o MountOptions) (sizeKnown bool, err error) {
	exp := s.exp
	s.stats = o.Stats // before any queue thread starts
	if err := s.handshake(); err != nil {
		return false, err
	}
	// Before anything but INIT is answered (see presetSize); a failure
	// leaves it to learnSize, once the loops run.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	sizeKnown, err = s.presetSize(ctx)
	cancel()
	if err != nil {
		exp.log.Info("kernel cache: the size reaches the kernel once serving", "why", err)
	}
	// More queues: the kernel spreads requests over them
	// (FUSE_DEV_IOC_CLONE).
	for i := 1; i < o.Queues; i++ {
		fd, err := s.cloneFd(false)
		if err != nil {
			return false, fmt.Errorf("fuse: queue %d: %w", i, err)
		}
		s.fds = append(s.fds, fd)
	}
	// One queue reads the image's completions where it has them (with
	// several, the requests read their own).
	if c, ok := formats.As[formats.Completions](exp.img); ok && len(s.fds) == 1 {
		s.comp = c
	}
	// Busy polling (--poll-us) spins on non-blocking reads; a queue that
	// reads completions never sleeps in read(2) either: it waits in
	// poll(2) on /dev/fuse and the completions' descriptors.
	s.pollFor = o.PollFor
	if s.pollFor > 0 || s.comp != nil {
		for _, fd := range s.fds {
			if err := unix.SetNonblock(fd, true); err != nil {
				return false, fmt.Errorf("fuse: non-blocking queue: %w", err)
			}
		}
	} else if o.ParkIdle > 0 {
		if err := s.parkWhenIdle(o.ParkIdle); err != nil {
			return false, err
		}
	}
	s.pace = !o.NoPace
	return sizeKnown, nil
}

// wireKernelCache gives the export, under the kernel cache, its calls into
// the kernel (drops; with the writeback cache the mending of a failed
// write-back, the kernel's size) and m the flush of its dirty pages.
func (s *server) wireKernelCache(m *Mount) {
	exp := s.exp
	if !exp.opts.KernelCache {
		return
	}
	s.calls = startKernelCalls()
	exp.inval = func(off, length int64) {
		if err := s.notifyInval(off, length); err != nil {
			exp.log.Warn("cannot invalidate the kernel's cache of the export", "err", err)
		}
	}
	if s.writebackCache() {
		file := m.file
		exp.writebackFailed = func(off, length int64) { s.mendFailedWriteback(file, off, length) }
		exp.kernelSize = func() (int64, bool) { return kernelSize(file) }
		m.flushCache = func() error { return s.flushKernelCache(file) }
	}
}

// serve serves the connection until it ends, then detaches a mount the
// kernel left behind and marks m served.
func (m *Mount) serve(s *server) {
	s.serve()
	if s.calls != nil {
		s.calls.close()
	}
	// The loops end when the kernel ends the connection (unmount,
	// abort) or on a protocol error; in the latter case a dead mount
	// (ENOTCONN) would stay behind, so detach it. Not after our own
	// unmount(2) (the flag may come just after the loops end: the mount
	// table is read then, as before): a deletion in a daemon holding
	// many mounts paid the read of every one (see mountPoint).
	if !m.unmounted.Load() && fuseMounted(m.path) {
		m.log.Error("FUSE connection ended while still mounted; detaching the mount", "mountpoint", m.path)
		detach(m.path, m.log)
	}
	close(m.served)
}

// mountFUSE mounts a FUSE file system of one regular file (or of a
// directory, for dir) on path and returns the /dev/fuse descriptor: with
// mount(2) as root, else through fusermount3 (see fusermount).
func mountFUSE(path, fsname string, writable, allowOther, dir bool) (int, error) {
	opts := []string{"default_permissions", fmt.Sprintf("max_read=%d", maxWrite)}
	if allowOther {
		opts = append(opts, "allow_other")
	}
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOATIME)
	if !writable {
		flags |= unix.MS_RDONLY
	}
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	openErr := err
	if err == nil {
		rootmode := unix.S_IFREG
		if dir {
			rootmode = unix.S_IFDIR
		}
		data := fmt.Sprintf("fd=%d,rootmode=%o,user_id=%d,group_id=%d,%s",
			fd, rootmode, os.Geteuid(), os.Getegid(), strings.Join(opts, ","))
		err = unix.Mount(escapeFsname(fsname), path, "fuse.blockexport", flags, data)
		if err == nil {
			return fd, nil
		}
		unix.Close(fd)
	}
	if !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EACCES) {
		return -1, err
	}
	// Not root: let the setuid helper mount.
	fmOpts := append(opts, "nosuid", "nodev", "noatime", "subtype=blockexport", "fsname="+escapeFusermountValue(escapeFsname(fsname)))
	if !writable {
		fmOpts = append(fmOpts, "ro")
	}
	fd, err = fusermount(path, strings.Join(fmOpts, ","))
	if err != nil && errors.Is(openErr, unix.EACCES) && strings.Contains(err.Error(), "/dev/fuse") {
		// fusermount3 opens /dev/fuse as the user too: say what to do.
		return -1, fmt.Errorf("permission denied opening /dev/fuse: run as root, or let this user open it (chmod 0666 /dev/fuse, the mode distributions ship, or a udev rule; membership of its group, where it has one) (%w)", err)
	}
	return fd, err
}

// escapeFsname keeps the mount source readable in /proc/mounts.
func escapeFsname(s string) string {
	return strings.NewReplacer(",", "_", " ", "_").Replace(s)
}

// escapeFusermountValue escapes an fsname= value as fusermount3 parses
// it: in fsname= and subtype= a backslash takes the next character
// literally (and is dropped). Unescaped, an image named "a\" made the
// option "fsname=a\,ro" swallow the ",ro" that follows: a read-only
// export mounted writable.
func escapeFusermountValue(s string) string {
	return strings.NewReplacer(`\`, `\\`, ",", `\,`).Replace(s)
}

// detach lazily unmounts path: with umount2(2) as root, through
// fusermount3 -u -z otherwise (a user's mount is fusermount3's to
// undo: umount2 fails with EPERM, and the mount would stay behind, dead).
func detach(path string, log *slog.Logger) error {
	err := unix.Unmount(path, unix.MNT_DETACH)
	if err == nil || errors.Is(err, unix.EINVAL) {
		return nil // unmounted, or not (or no longer) a mount point
	}
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
		if !fuseMounted(path) {
			return nil // not root, and no longer mounted (umount2 checks permission first)
		}
		out, ferr := exec.Command("fusermount3", "-u", "-z", "--", path).CombinedOutput()
		if ferr == nil {
			return nil
		}
		err = fmt.Errorf("fusermount3 -u: %v: %s", ferr, strings.TrimSpace(string(out)))
	}
	log.Warn("cannot unmount the export", "mountpoint", path, "err", err)
	return fmt.Errorf("unmount %s: %w", path, err)
}

// fusermount runs fusermount3 with _FUSE_COMMFD and receives the
// /dev/fuse descriptor it opened and mounted.
func fusermount(path, opts string) (int, error) {
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socketpair: %w", err)
	}
	local, remote := os.NewFile(uintptr(pair[0]), "fusermount-local"), os.NewFile(uintptr(pair[1]), "fusermount-remote")
	defer local.Close()
	cmd := exec.Command("fusermount3", "-o", opts, "--", path)
	cmd.ExtraFiles = []*os.File{remote}
	cmd.Env = append(os.Environ(), "_FUSE_COMMFD=3")
	out, err := cmd.CombinedOutput()
	remote.Close()
	if err != nil {
		return -1, fmt.Errorf("fusermount3: %v: %s", err, strings.TrimSpace(string(out)))
	}
	buf := make([]byte, 1)
	oob := make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(pair[0], buf, oob, 0)
	if err != nil {
		return -1, fmt.Errorf("fusermount3: receiving the descriptor: %w", err)
	}
	var fds []int
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err == nil && len(msgs) > 0 {
		fds, err = unix.ParseUnixRights(&msgs[0])
	}
	if err != nil || len(fds) == 0 {
		return -1, fmt.Errorf("fusermount3 sent no descriptor")
	}
	unix.CloseOnExec(fds[0])
	return fds[0], nil
}

// Path is the absolute mountpoint.
func (m *Mount) Path() string { return m.path }

// File is the exported file: the mountpoint, or the file in it.
func (m *Mount) File() string { return m.file }

// Done is closed when the kernel has ended the connection (unmounted from
// outside or by Unmount) and every request has been answered.
func (m *Mount) Done() <-chan struct{} { return m.served }

// Unmount stops the export and returns once every request in flight is
// answered. A file still in use (open files, a loop device) is detached
// lazily and its connection aborted: users get ENOTCONN rather than hang
// on a daemon going away. Removing a mountpoint file we made is Cleanup's.
func (m *Mount) Unmount() error {
	if m.flushCache != nil {
		if err := m.flushCache(); err != nil {
			m.log.Warn("cannot write the kernel's cached writes back before unmounting; an abort may lose writes not yet fsynced", "err", err)
		}
	}
	var err error
	for try := 0; try < 5; try++ {
		if err = unix.Unmount(m.path, 0); err == nil || errors.Is(err, unix.EINVAL) {
			m.unmounted.Store(err == nil)
			err = nil
			break
		}
		if !errors.Is(err, unix.EBUSY) {
			break
		}
		time.Sleep(time.Duration(10<<try) * time.Millisecond)
	}
	switch {
	case err == nil:
	case errors.Is(err, unix.EBUSY):
		m.log.Warn("export still in use; detaching it and aborting its connection", "mountpoint", m.path)
		if err := unix.Unmount(m.path, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount %s: %w", m.path, err)
		}
		m.abort()
	case errors.Is(err, unix.EPERM):
		// Not root: fusermount3 mounted it, fusermount3 unmounts it.
		if err := detach(m.path, m.log); err != nil {
			return err
		}
	default:
		return fmt.Errorf("unmount %s: %w", m.path, err)
	}
	<-m.served
	return nil
}

// abort ends the FUSE connection through fusectl, mounting fusectl first if
// needed. Without it, the connection ends when its last user closes it.
func (m *Mount) abort() {
	const ctl = "/sys/fs/fuse/connections"
	file := filepath.Join(ctl, strconv.FormatUint(m.conn, 10), "abort")
	if _, err := os.Stat(file); err != nil {
		unix.Mount("fusectl", ctl, "fusectl", 0, "")
	}
	if err := os.WriteFile(file, []byte("1"), 0); err != nil {
		m.log.Warn("cannot abort the FUSE connection; it ends when the last user closes the file", "err", err)
	}
}

// Cleanup removes the mountpoint file if Mount created it and it is
// still the file it created. Call it after Done is closed.
func (m *Mount) Cleanup() {
	if err := m.made.remove(); err != nil {
		m.log.Warn("cannot remove the mountpoint we created", "path", m.path, "err", err)
	}
}

// Abandon is the way out for a process about to exit at once (a second
// signal while stopping): no request is waited for; the mount is detached
// and a mountpoint file we made removed. It may run while Unmount waits.
func (m *Mount) Abandon() {
	detach(m.path, m.log)
	m.Cleanup()
}
