package engine

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/jobs/commit"
	"github.com/blockexport/blockexport/formats/registry"
)

// mirrorGranule is the most an active commit copies again for one write
// (QEMU's mirror granularity: the base's cluster size, at most 64 KiB).
const mirrorGranule = 64 << 10

// catchUpEvery is how often a ready active commit copies what was
// written since it last looked.
const catchUpEvery = 50 * time.Millisecond

// activeCommit starts block-commit of the node's own image into base (a
// layer's file name; "": the bottom of its chain), QEMU's active commit:
// a mirror from the node's image into the base. What the layers above
// the base hold is copied, then every range written through the node
// since the job began (the node's pivotImage notes them) until none is
// left: the job is ready (BLOCK_JOB_READY) and goes on copying new
// writes until job-complete. At finalize, with no request in flight, the
// last writes are copied and the node pivots: it is the base from then
// on, its exports with it, and the old top is closed as it is (it still
// names its backing file). A cancel leaves the top in place; the base
// holds what was copied, each consistent.
func (e *Engine) activeCommit(o JobOptions, n *node, base string) error {
	p, ok := n.img.(*pivotImage)
	if !ok {
		return genericf("cannot commit an image into itself")
	}
	img := p.img
	if o.BackingFile != "" {
		return genericf("'backing-file' specified, but 'top' is the active layer")
	}
	var b chainLayer
	if base != "" {
		if b, ok = findLayer(img, base); !ok {
			return genericf("Can't find '%s' in the backing chain", base)
		}
	} else {
		for layer := img; ; {
			next, ok := findBacking(layer)
			if !ok {
				break
			}
			b.depth++
			b.img, b.above, b.path = next, layer, layer.Info().FullBackingFilename
			layer = next
		}
	}
	if b.depth == 0 {
		return genericf("cannot commit an image into itself")
	}
	if n.readOnly {
		return genericf("Node '%s' is read-only: an active commit writes through it", n.name)
	}
	baseFormat := b.format()
	bo, err := registry.Open(b.path, registry.Options{Format: baseFormat, Writable: true, Backend: e.o.Backend, Logger: e.log})
	if err != nil {
		return openError(b.path, err)
	}
	granule := int64(mirrorGranule)
	if cs := bo.Image.Info().ClusterSize; cs >= 512 && cs < granule {
		granule = cs
	}
	dirty := newDirtyMap(img.Size(), granule)
	j := &job{JobOptions: o, typ: "commit", node: n, complete: make(chan struct{}), midLayers: b.depth > 1}
	j.total.Store(img.Size())
	j.refuse = func() error { return e.activeCommitConflict(n, j.ID) }
	var (
		once    sync.Once
		pivoted bool
	)
	j.cleanup = func() {
		once.Do(func() {
			p.swap(context.Background(), func() error { p.dirty = nil; return nil })
			if !pivoted {
				bo.Image.Close()
			}
		})
	}
	// Writes are noted from before the first copy begins: one that lands
	// behind the copy is copied again.
	p.swap(context.Background(), func() error { p.dirty = dirty; return nil })
	catchUp := func(ctx context.Context) error {
		buf := make([]byte, 1<<20)
		for {
			runs := dirty.take()
			if len(runs) == 0 {
				return nil
			}
			for _, r := range runs {
				for off, end := r[0], min(r[0]+r[1], img.Size()); off < end; {
					k := min(end-off, int64(len(buf)))
					if _, err := img.ReadAt(ctx, buf[:k], off); err != nil {
						return fmt.Errorf("read [%d, +%d) written during the commit: %w", off, k, err)
					}
					if _, err := bo.Image.WriteAt(ctx, buf[:k], off); err != nil {
						return fmt.Errorf("write into the base [%d, +%d): %w", off, k, err)
					}
					off += k
				}
				j.cur.Add(r[1])
			}
		}
	}
	var copied int64 // the first pass's bytes, the job's length before writes
	j.finalize = func(ctx context.Context) error {
		return p.swap(ctx, func() error {
			if err := catchUp(ctx); err != nil {
				return err
			}
			j.total.Store(copied + dirty.grown())
			j.cur.Store(j.total.Load())
			if err := bo.Image.Flush(ctx); err != nil {
				return fmt.Errorf("flush the base: %w", err)
			}
			p.dirty = nil
			e.pivot(n, p, bo, b.path, baseFormat)
			e.nameLayers(n) // the base's own layers are the node's now
			pivoted = true
			once.Do(func() {})
			return nil
		})
	}
	err = e.startJob(j, func(ctx context.Context, j *job) error {
		err := commit.Commit(ctx, img, bo.Image, b.depth, commit.Options{Rate: j.Speed, Progress: func(done, total int64) {
			copied = total
			j.cur.Store(done)
			j.total.Store(total + dirty.grown())
		}})
		if err == nil {
			err = catchUp(ctx)
		}
		if err != nil {
			return err
		}
		go e.jobReady(j)
		tick := time.NewTicker(catchUpEvery)
		defer tick.Stop()
		for {
			j.total.Store(copied + dirty.grown())
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-j.complete:
				err := catchUp(ctx)
				j.total.Store(copied + dirty.grown())
				return err
			case <-tick.C:
				if err := catchUp(ctx); err != nil {
					return err
				}
			}
		}
	})
	if err != nil {
		j.cleanup()
	}
	return err
}

// jobReady moves a running job to ready, with BLOCK_JOB_READY; one that
// was cancelled or failed meanwhile stays as it is.
func (e *Engine) jobReady(j *job) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if j.status != "running" {
		return
	}
	e.setStatus(j, "ready")
	e.event("BLOCK_JOB_READY", e.jobEventData(j, ""))
}

// activeCommitConflict is QEMU 7.2's refusal of an active commit of a
// node a writable FUSE export holds: the export takes resize, which the
// commit's filter node unshares.
func (e *Engine) activeCommitConflict(n *node, id string) error {
	for _, x := range e.exports {
		if x.node == n && x.mount != nil && x.o.Writable {
			return e.resizeConflictWith(id)
		}
	}
	return nil
}

func (e *Engine) resizeConflictWith(id string) error {
	f := e.autoNodeName()
	return genericf("Permission conflict on node '%s': permissions 'resize' are both required by an unnamed block device (uses node '%s' as 'root' child) and unshared by commit job '%s' (uses node '%s' as 'main node' child).", f, f, id, f)
}

// autoNodeName names a node QEMU would have made (a job's filter node,
// a layer of a chain), as QEMU names it, for its messages (under mu).
func (e *Engine) autoNodeName() string {
	e.implicit++
	return fmt.Sprintf("#block%03d", e.implicit)
}

// exportConflict is QEMU 7.2's refusal of a new export of a node under
// an active commit with layers between it and the base: the export's
// permissions are checked again over the chain, and the commit job
// unshares consistent read on the layer in between. Without such a
// layer, a writable FUSE export still conflicts on resize, as at the
// job's start (under mu).
func (e *Engine) exportConflict(n *node, o ExportOptions) error {
	j := e.jobOn(n)
	switch {
	case j == nil || j.complete == nil:
		return nil
	case j.midLayers:
		f := e.autoNodeName()
		return genericf("Permission conflict on node '%s': permissions 'consistent read' are both required by node '%s' (uses node '%s' as 'backing' child) and unshared by commit job '%s' (uses node '%s' as 'intermediate node' child).", f, n.name, f, j.ID, f)
	case o.Type == "fuse" && o.Writable:
		return e.resizeConflictWith(j.ID)
	}
	return nil
}

// pivot makes the node the base (under p's drain and mu): the old top's
// chain closes, and the base is opened again with its locks, now that
// the old chain let its read lock go; where that fails the base stays
// open as the job opened it, without locks.
func (e *Engine) pivot(n *node, p *pivotImage, bo *registry.Opened, path, format string) {
	if err := p.img.Close(); err != nil {
		e.log.Warn("closing the committed top", "node-name", n.name, "err", err)
	}
	next := bo
	opened, err := registry.Open(path, registry.Options{Format: format, Writable: true, Lock: true, Backend: e.o.Backend, Logger: e.log})
	if err != nil {
		e.log.Warn("the base stays open without its locks", "node-name", n.name, "err", err)
	} else {
		if err := bo.Image.Close(); err != nil {
			e.log.Warn("closing the job's open of the base", "node-name", n.name, "err", err)
		}
		next = opened
	}
	var img formats.Image = next.Image
	p.img, n.opened = img, next
	n.path, n.filename, n.driver = path, path, format
	e.log.Info("active commit pivoted", "node-name", n.name, "file", path)
}
