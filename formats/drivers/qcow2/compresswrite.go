package qcow2

import (
	"bytes"
	"context"
	"fmt"
	"sync"

	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/zstd"

	"github.com/blockexport/blockexport/formats"
)

// Compressed-cluster writing, as qemu-img convert -c does it.
//
// A cluster is compressed whole (the image's last one padded with
// zeroes) with the image's compression type: zlib as QEMU writes it, raw
// deflate with a 4 KiB window (QEMU inflates with windowBits -12, so no
// match may reach further back), or a zstd frame. Only a result of at
// most cluster_size-1 bytes is stored compressed; otherwise the cluster is
// written as data, as QEMU does.
//
// Compressed clusters are packed byte after byte into host clusters, a
// compressed cluster running on into the next host cluster when that one
// is allocated right after (QEMU's qcow2_alloc_bytes). Every host cluster
// a compressed cluster's sectors touch counts it once in its refcount, as
// QEMU counts and frees them (freeLater). The order of writes is that of
// any allocating write: the bytes, then (in memory until Flush) the
// refcounts and the L2 entry, so a crash leaks at worst.

// zlibWindow is QEMU's deflate window (windowBits 12).
const zlibWindow = 4096

// Encoders hold large tables, so they are reused from free lists that a
// garbage collection does not empty (a sync.Pool's rebuilds brought on
// more collections); the lists are stacks, so the encoder handed out is
// the one whose tables are still in the CPU's cache.
var (
	freeDeflaters freeList[*flate.Writer]
	freeZstd      freeList[*zstd.Encoder]
	freeScratch   freeList[[]byte]
)

// freeList is a bounded LIFO of reusable encoders.
type freeList[T any] struct {
	mu   sync.Mutex
	list []T
}

func (l *freeList[T]) get() (T, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var x T
	n := len(l.list)
	if n == 0 {
		return x, false
	}
	x = l.list[n-1]
	l.list[n-1] = *new(T)
	l.list = l.list[:n-1]
	return x, true
}

func (l *freeList[T]) put(x T) {
	l.mu.Lock()
	if len(l.list) < 256 {
		l.list = append(l.list, x)
	}
	l.mu.Unlock()
}

// zstdWindow bounds the encoder's window (and memory): a cluster is at
// most 2 MiB, and matches further back than this gain little.
const zstdWindow = 1 << 17

func getDeflater() (*flate.Writer, error) {
	if w, ok := freeDeflaters.get(); ok {
		return w, nil
	}
	return flate.NewWriterWindow(nil, zlibWindow)
}

func getZstd() (*zstd.Encoder, error) {
	if e, ok := freeZstd.get(); ok {
		return e, nil
	}
	// No content checksum, as QEMU writes its frames (libzstd's default):
	// the image has no use for it.
	return zstd.NewWriter(nil, zstd.WithEncoderConcurrency(1), zstd.WithEncoderLevel(zstd.SpeedDefault),
		zstd.WithWindowSize(zstdWindow), zstd.WithLowerEncoderMem(true), zstd.WithEncoderCRC(false))
}

// ClusterSize is the image's cluster size.
func (q *Image) ClusterSize() int64 { return q.h.clusterSize }

// CompressCluster compresses p, one cluster (or the image's last, shorter
// one), with the image's compression type. ok false: the result would
// not be smaller than cluster_size-1 bytes, and the cluster is better
// written as data. Safe for concurrent use; it touches no image state.
func (q *Image) CompressCluster(p []byte) (comp []byte, ok bool, err error) {
	cs := q.h.clusterSize
	if int64(len(p)) > cs || len(p) == 0 {
		return nil, false, fmt.Errorf("qcow2: compress %d bytes: want one cluster of %d", len(p), cs)
	}
	src := p
	if int64(len(p)) < cs {
		src = make([]byte, cs) // the last cluster, padded as QEMU pads it
		copy(src, p)
	}
	// The encoder writes into a reused scratch buffer; only a result
	// that is kept is copied out, at its own size.
	scratch, _ := freeScratch.get()
	if int64(cap(scratch)) < cs {
		scratch = make([]byte, 0, cs)
	}
	defer func() { freeScratch.put(scratch[:0]) }()
	switch q.h.compressionType {
	case compressionZlib:
		w, err := getDeflater()
		if err != nil {
			return nil, false, fmt.Errorf("qcow2: deflate: %w", err)
		}
		out := bytes.NewBuffer(scratch[:0])
		w.Reset(out)
		_, err = w.Write(src)
		if err == nil {
			err = w.Close()
		}
		freeDeflaters.put(w)
		if err != nil {
			return nil, false, fmt.Errorf("qcow2: deflate: %w", err)
		}
		comp = out.Bytes()
	case compressionZstd:
		e, err := getZstd()
		if err != nil {
			return nil, false, fmt.Errorf("qcow2: zstd: %w", err)
		}
		comp = e.EncodeAll(src, scratch[:0])
		freeZstd.put(e)
	default:
		return nil, false, fmt.Errorf("qcow2: compression type %d: %w", q.h.compressionType, formats.ErrNotSupported)
	}
	if int64(len(comp)) > cs-1 {
		return nil, false, nil
	}
	comp = append([]byte(nil), comp...) // scratch goes back to the list
	return comp, true, nil
}

// WriteCompressed stores comp, what CompressCluster returned, as the
// cluster at virtual offset off (cluster-aligned). Whatever the cluster
// was is freed as any overwritten cluster is.
func (q *Image) WriteCompressed(ctx context.Context, comp []byte, off int64) error {
	defer q.wrote()
	if err := q.checkWritable("compressed write"); err != nil {
		return err
	}
	cs := q.h.clusterSize
	if off < 0 || off%cs != 0 || off >= q.Size() {
		return fmt.Errorf("qcow2: compressed write at %d: %w", off, formats.ErrOutOfRange)
	}
	n := int64(len(comp))
	if n == 0 || n > cs-1 {
		return fmt.Errorf("qcow2: compressed write of %d bytes: want 1 to %d", n, cs-1)
	}
	w := q.w
	w.users.RLock()
	q.markDirty(off, cs)
	err := q.writeCompressed(ctx, comp, off)
	w.users.RUnlock()
	if err != nil {
		return err
	}
	return q.boundWriteBack(ctx)
}

func (q *Image) writeCompressed(ctx context.Context, comp []byte, off int64) error {
	w := q.w
	cs := q.h.clusterSize
	n := int64(len(comp))
	vc := off / cs
	unlock, err := w.clusters.Lock(ctx, vc*cs, cs)
	if err != nil {
		return err
	}
	defer unlock()
	old, _, err := q.lookup(ctx, vc)
	if err != nil {
		return err
	}
	w.alloc.Lock()
	host, err := q.allocBytes(ctx, n)
	w.alloc.Unlock()
	if err != nil {
		return err
	}
	// A compressed cluster freed from these very bytes may still be in
	// the decompressed cache, keyed by where it lay.
	q.dcache.Remove(host)
	err = q.checkWrite(ctx, host, n, metaNone, "compressed cluster write")
	if err == nil {
		if _, err = q.f.WriteAt(ctx, comp, host); err != nil {
			err = fmt.Errorf("qcow2: write a compressed cluster of %d bytes at host %#x: %w", n, host, err)
		}
	}
	w.alloc.Lock()
	defer w.alloc.Unlock()
	if err != nil {
		q.dropBytes(ctx, host, n)
		return err
	}
	x := 62 - (q.h.clusterBits - 8)
	sectors := uint64((host+n-1)>>9 - host>>9) // additional sectors
	if sectors >= 1<<(q.h.clusterBits-8) || host >= 1<<x {
		q.dropBytes(ctx, host, n)
		return fmt.Errorf("qcow2: compressed cluster at host %#x (+%d) does not fit an L2 entry", host, n)
	}
	e := uint64(host) | sectors<<x | l2Compressed
	if err := q.setL2(ctx, vc, e); err != nil {
		q.dropBytes(ctx, host, n)
		return err
	}
	q.freeLater(old.entry)
	return nil
}

// allocBytes finds n bytes (less than a cluster) for a compressed
// cluster: after the last one, in its host cluster or running on into the
// next when that is the one allocated next, else at the start of a new
// cluster. Each host cluster the bytes touch gains one reference. The
// caller holds alloc.
func (q *Image) allocBytes(ctx context.Context, n int64) (int64, error) {
	w := q.w
	cs := q.h.clusterSize
	if off := w.compNext; off > 0 && off%cs != 0 {
		c := off / cs
		rc, err := q.getRef(ctx, c)
		if err != nil {
			return 0, err
		}
		// A cluster freed meanwhile (compFreed resets compNext) or at
		// its largest refcount is left alone.
		if rc > 0 && rc < w.maxRef {
			var next int64 // the cluster the bytes run on into; 0: none
			if off+n > (c+1)*cs {
				if next, err = q.allocClusters(ctx, 1); err != nil {
					return 0, err
				}
				if next != (c+1)*cs {
					w.compNext = next + n
					return next, nil
				}
			}
			if err := q.setRef(ctx, c, rc+1); err != nil {
				if next != 0 {
					q.unallocate(ctx, next, 1)
				}
				return 0, err
			}
			w.compNext = off + n
			return off, nil
		}
	}
	next, err := q.allocClusters(ctx, 1)
	if err != nil {
		return 0, err
	}
	w.compNext = next + n
	return next, nil
}

// dropBytes takes back the references allocBytes gave [host, host+n),
// whose write failed: nothing points at them. The caller holds alloc.
func (q *Image) dropBytes(ctx context.Context, host, n int64) {
	cs := q.h.clusterSize
	for c := host / cs; c <= (host+n-1)/cs; c++ {
		rc, err := q.getRef(ctx, c)
		if err == nil && rc > 0 {
			err = q.setRef(ctx, c, rc-1)
		}
		if err != nil {
			q.logWarn("leaking a cluster after a failed compressed write", err)
			continue
		}
		if rc == 1 {
			q.compFreed(c)
			q.w.freeHint = min(q.w.freeHint, c)
		}
	}
}

// compFreed notes that host cluster c is free again: compressed clusters
// must no longer be packed into it. The caller holds alloc.
func (q *Image) compFreed(c int64) {
	w := q.w
	if w.compNext > 0 && w.compNext/q.h.clusterSize == c {
		w.compNext = 0
	}
}
