package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/jobs/commit"
	"github.com/blockexport/blockexport/formats/jobs/stream"
	"github.com/blockexport/blockexport/formats/registry"
)

// JobOptions are what block-stream and block-commit share.
type JobOptions struct {
	ID           string
	Device       string
	AutoFinalize bool
	AutoDismiss  bool
	// Speed caps the bytes copied a second (0: no cap).
	Speed int64
	// BackingFile is the backing file name written at finalize, as it is
	// (QEMU's backing-file); "": the base's file name.
	BackingFile string
}

// JobInfo is one entry of query-jobs, its members in QEMU's order.
type JobInfo struct {
	CurrentProgress int64  `json:"current-progress"`
	Status          string `json:"status"`
	TotalProgress   int64  `json:"total-progress"`
	Type            string `json:"type"`
	ID              string `json:"id"`
	Error           string `json:"error,omitempty"`
}

// job is one block job. Its work runs in a goroutine; every change of
// status happens under the engine's lock, with its event, in QEMU's
// sequence: created, running, waiting, pending, concluded, null (or
// aborting, concluded, null when cancelled or failed).
type job struct {
	JobOptions
	typ    string // "stream", "commit"
	node   *node
	status string
	// cur is the progress, written by the work without the engine's
	// lock: a cancel waits for the work under it.
	cur, total atomic.Int64
	// ended: the job's end was handled (its work's end or a cancel).
	ended  bool
	cancel context.CancelFunc
	// worked is closed when the work ends, before its status moves on.
	worked chan struct{}
	err    error
	// finalize is the job's graph change at finalize (nil: none).
	finalize func(ctx context.Context) error
	// refuse, when set, may refuse the job once it is made (QEMU's
	// permission checks as the job's filter node goes in).
	refuse func() error
	// complete is closed by job-complete (a job that reaches ready).
	complete chan struct{}
	// cleanup, when set, runs once when the job ends without finalize.
	cleanup func()
	// midLayers: an active commit with layers between the node's image
	// and the base.
	midLayers bool
}

func (e *Engine) setStatus(j *job, status string) {
	j.status = status
	e.event("JOB_STATUS_CHANGE", struct {
		Status string `json:"status"`
		ID     string `json:"id"`
	}{status, j.ID})
}

// startJob registers j and runs work in the background.
func (e *Engine) startJob(j *job, work func(ctx context.Context, j *job) error) error {
	if j.ID == "" {
		j.ID = j.node.name // QEMU names the job after the device then
	}
	if !nodeName.MatchString(j.ID) { // QEMU's id_wellformed, as node names
		return genericf("Invalid job ID '%s'", j.ID)
	}
	if slices.ContainsFunc(e.jobs, func(o *job) bool { return o.ID == j.ID }) {
		return genericf("Job ID '%s' already in use", j.ID)
	}
	if j.Speed < 0 {
		// QEMU makes the job, then fails to set its speed.
		e.setStatus(j, "created")
		e.setStatus(j, "null")
		return genericf("Parameter 'speed' expects a non-negative value")
	}
	if j.refuse != nil {
		if err := j.refuse(); err != nil {
			e.setStatus(j, "created")
			e.setStatus(j, "null")
			return err
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	j.cancel, j.worked = cancel, make(chan struct{})
	e.jobs = append(e.jobs, j)
	e.setStatus(j, "created")
	e.setStatus(j, "running")
	e.log.Info("block job started", "id", j.ID, "type", j.typ, "node-name", j.node.name)
	go func() {
		err := work(ctx, j)
		close(j.worked)
		e.mu.Lock()
		defer e.mu.Unlock()
		if !j.ended {
			e.jobDone(j, err)
		}
	}()
	return nil
}

// jobDone moves a job on once its work ended (under mu).
func (e *Engine) jobDone(j *job, err error) {
	j.ended = true
	if j.status == "aborting" || err != nil {
		j.err = err
		e.abortJob(j)
		return
	}
	j.cur.Store(j.total.Load())
	e.setStatus(j, "waiting")
	e.setStatus(j, "pending")
	if !j.AutoFinalize {
		e.event("BLOCK_JOB_PENDING", struct {
			Type string `json:"type"`
			ID   string `json:"id"`
		}{j.typ, j.ID})
		return
	}
	e.finalizeJob(j)
}

func (e *Engine) finalizeJob(j *job) {
	if j.finalize != nil {
		if err := j.finalize(context.Background()); err != nil {
			j.err = err
			e.abortJob(j)
			return
		}
	}
	e.event("BLOCK_JOB_COMPLETED", e.jobEventData(j, ""))
	e.concludeJob(j)
}

// abortJob ends a cancelled or failed job: a failure is told by
// BLOCK_JOB_COMPLETED with its error, a cancel by BLOCK_JOB_CANCELLED.
func (e *Engine) abortJob(j *job) {
	if j.cleanup != nil {
		j.cleanup()
	}
	if j.status != "aborting" {
		e.setStatus(j, "aborting")
	}
	if j.err != nil && !errors.Is(j.err, context.Canceled) {
		e.event("BLOCK_JOB_COMPLETED", e.jobEventData(j, j.err.Error()))
	} else {
		j.err = nil
		e.event("BLOCK_JOB_CANCELLED", e.jobEventData(j, ""))
	}
	e.concludeJob(j)
}

func (e *Engine) concludeJob(j *job) {
	e.setStatus(j, "concluded")
	e.log.Info("block job concluded", "id", j.ID, "err", j.err)
	if j.AutoDismiss {
		e.dismissJob(j)
	}
}

func (e *Engine) dismissJob(j *job) {
	e.setStatus(j, "null")
	e.jobs = slices.DeleteFunc(e.jobs, func(o *job) bool { return o == j })
}

// jobEvent is the data of BLOCK_JOB_COMPLETED and BLOCK_JOB_CANCELLED,
// its members in the order QSD 7.2 sends them.
type jobEvent struct {
	Device string `json:"device"`
	Len    int64  `json:"len"`
	Offset int64  `json:"offset"`
	Speed  int64  `json:"speed"`
	Type   string `json:"type"`
	Error  string `json:"error,omitempty"`
}

func (e *Engine) jobEventData(j *job, errText string) jobEvent {
	return jobEvent{Device: j.ID, Len: j.total.Load(), Offset: j.cur.Load(), Speed: j.Speed, Type: j.typ, Error: errText}
}

// Jobs lists the jobs (query-jobs).
func (e *Engine) Jobs() []JobInfo {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := []JobInfo{}
	for _, j := range e.jobs {
		ji := JobInfo{CurrentProgress: j.cur.Load(), Status: j.status, TotalProgress: j.total.Load(), Type: j.typ, ID: j.ID}
		if j.err != nil {
			ji.Error = j.err.Error()
		}
		out = append(out, ji)
	}
	return out
}

// JobVerb runs job-cancel, job-complete, job-finalize or job-dismiss on
// the job id, refused in QEMU's words where its state does not take it.
func (e *Engine) JobVerb(id, verb string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	i := slices.IndexFunc(e.jobs, func(o *job) bool { return o.ID == id })
	if i < 0 {
		return genericf("Job not found")
	}
	j := e.jobs[i]
	allowed := map[string][]string{
		"cancel":   {"created", "running", "paused", "ready", "standby", "waiting", "pending"},
		"finalize": {"pending"},
		"dismiss":  {"concluded"},
		"complete": {"ready"}, // an active commit's
	}[verb]
	if !slices.Contains(allowed, j.status) {
		return genericf("Job '%s' in state '%s' cannot accept command verb '%s'", id, j.status, verb)
	}
	switch verb {
	case "cancel":
		// Its end comes before the reply, as in QEMU: the work stops at
		// its next step (it takes no engine lock), flushed.
		e.setStatus(j, "aborting")
		j.cancel()
		<-j.worked
		j.ended = true
		e.abortJob(j)
	case "complete":
		select {
		case <-j.complete: // completing already: QEMU takes it again
		default:
			close(j.complete)
		}
	case "finalize":
		e.finalizeJob(j)
	case "dismiss":
		e.dismissJob(j)
	}
	return nil
}

// jobOn is the job that holds n (under mu; nil: none).
func (e *Engine) jobOn(n *node) *job {
	for _, j := range e.jobs {
		if j.node == n && j.status != "concluded" {
			return j
		}
	}
	return nil
}

// busy refuses a node a job holds, as QEMU's op blockers do (under mu).
func (e *Engine) busy(n *node) error {
	if j := e.jobOn(n); j != nil {
		return genericf("Node '%s' is busy: block device is in use by block job: %s", n.name, j.typ)
	}
	return nil
}

func (e *Engine) jobNode(device string) (*node, error) {
	n := e.node(device)
	if n == nil {
		return nil, &Error{Class: DeviceNotFound, Desc: fmt.Sprintf("Device '%s' not found", device)}
	}
	if u := e.backingUser(n); u != nil {
		// The overlay reads n's files through its own open of its chain:
		// a job writing them under it would leave it reading stale
		// metadata.
		return n, genericf("Node '%s' is given as the backing of node '%s': a job on it is not taken here while that node is there", n.name, u.name)
	}
	return n, e.busy(n)
}

// Stream starts block-stream of device's backing chain, down to base
// (a layer's file name; "": the whole chain) into device's image; bottom
// may name the device's node itself (nothing is streamed then). The
// graph change comes at finalize, as QEMU makes it in the job's prepare
// step: the image stands alone, or names base as its backing file (or
// o.BackingFile, unchecked, as QEMU writes it).
func (e *Engine) Stream(o JobOptions, base, baseNode, bottom string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.node(o.Device) == nil { // QEMU looks a stream's device up as a node
		return genericf("Cannot find device='%s' nor node-name='%s'", o.Device, o.Device)
	}
	n, err := e.jobNode(o.Device)
	if err != nil {
		return err
	}
	var lay chainLayer
	if base != "" {
		var ok bool
		if lay, ok = findLayer(n.core(), base); !ok {
			return genericf("Can't find '%s' in the backing chain", base)
		}
	}
	if baseNode != "" {
		d, err := e.chainDepth(n, baseNode)
		if err != nil {
			return err
		}
		if d <= 0 {
			return genericf("Node '%s' is not a backing image of '%s'", baseNode, o.Device)
		}
		lay = layerAt(n.core(), d)
	}
	bottomDepth := -1
	if bottom != "" {
		var err error
		if bottomDepth, err = e.chainDepth(n, bottom); err != nil {
			return err
		}
		if bottomDepth < 0 {
			return genericf("Node '%s' is not in a chain starting from '%s'", bottom, o.Device)
		}
		// The bottom is the last layer streamed, the one below it the
		// base (none: the whole chain). The node itself as the bottom
		// streams nothing, and it keeps its backing file.
		lay = layerAt(n.core(), bottomDepth+1)
	}
	if lay.depth == 0 && o.BackingFile != "" {
		return genericf("backing file specified, but streaming the entire chain")
	}
	if n.img == nil || n.readOnly {
		return genericf("Node '%s' is read-only: a stream writes it", n.name)
	}
	img := n.core()
	j := &job{JobOptions: o, typ: "stream", node: n}
	// A stream with nothing under the node (it is the bottom itself, or
	// it was opened with backing: null) ends at once, of length 0, as
	// QEMU's does.
	if bottomDepth != 0 && !n.noBacking {
		j.total.Store(img.Size())
	}
	j.finalize = func(ctx context.Context) error {
		if n.noBacking {
			return nil // nothing under it was read: its header stays, as QEMU leaves it
		}
		setter, ok := img.(backingSetter)
		if _, layered := findBacking(img); !ok && !layered {
			return nil // nothing was streamed (a null-co node)
		} else if !ok {
			return fmt.Errorf("node '%s' (driver %s) cannot change its backing file: only qcow2 can", n.name, n.driver)
		}
		var err error
		if lay.depth == 0 {
			err = setter.SetBacking(ctx, "", "")
		} else {
			err = setter.SetBacking(ctx, cmp.Or(o.BackingFile, lay.path), lay.format())
		}
		if err != nil {
			return err
		}
		return e.reopenChain(n)
	}
	return e.startJob(j, func(ctx context.Context, j *job) error {
		err := stream.Stream(ctx, img, stream.StreamOptions{Base: lay.depth, KeepBacking: true, Progress: e.progress(ctx, j)})
		if errors.Is(err, stream.ErrNoBackingFile) {
			return nil
		}
		return err
	})
}

// progress records a stream's progress (QEMU counts the image's length,
// done when the job is; so does this) and holds it to the job's speed:
// the stream waits for its callback.
func (e *Engine) progress(ctx context.Context, j *job) func(off, n, done, durable, total int64) {
	start := time.Now()
	return func(off, n, done, durable, total int64) {
		if c := min(off+n, j.total.Load()); c > j.cur.Load() {
			j.cur.Store(c) // only this callback writes it, one call at a time
		}
		if j.Speed <= 0 {
			return
		}
		due := time.Duration(float64(done) / float64(j.Speed) * float64(time.Second))
		t := time.NewTimer(due - time.Since(start))
		defer t.Stop()
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	}
}

// Commit starts block-commit of the layer top of device's chain (any
// layer below the node's own image) into base, a layer below it (""
// the bottom of the chain, as QEMU defaults). At finalize the layer above
// top names base as its backing file (or o.BackingFile, as QEMU writes
// it): the node's own image when top is its backing file, else a layer
// below it, opened writable for that change alone. The active layer
// needs a mirror, which is not here.
func (e *Engine) Commit(o JobOptions, top, base, topNode, baseNode string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	n, err := e.jobNode(o.Device)
	if j := e.jobOn(n); err != nil && j != nil && (j.typ == "stream" || j.complete != nil) {
		// QEMU 7.2: the stream's or the active commit's filter node is
		// on top of the node.
		return genericf("Need a root block node")
	}
	if err != nil {
		return err
	}
	if n.backingRef != nil {
		// The layers below are the given node's, which a commit would
		// write under it.
		return genericf("Node '%s' stands on node '%s' given as its backing: a commit into that node's chain is not taken here", n.name, n.backingRef.name)
	}
	img := n.core()
	top, base, err = e.commitLayerFiles(n, img, top, base, topNode, baseNode)
	if err != nil {
		return err
	}
	if img != nil && (top == "" || commit.SameFile(top, img.Info().Filename)) {
		return e.activeCommit(o, n, base)
	}
	if img == nil { // a file node: no backing chain
		if top != "" {
			return genericf("Top image file %s not found", top)
		}
		return genericf("cannot commit an image into itself")
	}
	if n.readOnly {
		return genericf("Node '%s' is read-only: a commit rewrites its backing file name", n.name)
	}
	l, err := findCommitLayers(img, top, base)
	if err != nil {
		return err
	}
	setter, ok := l.above.(backingSetter)
	if !ok {
		return genericf("Image '%s' cannot change its backing file: only qcow2 can", l.above.Info().Filename)
	}
	// The node's chain holds the base open read-only under its lock;
	// the writable open goes without one, as QEMU reopens the base.
	bo, err := registry.Open(l.base.path, registry.Options{Format: l.base.format(), Writable: true, Backend: e.o.Backend, Logger: e.log})
	if err != nil {
		return openError(l.base.path, err)
	}
	j := &job{JobOptions: o, typ: "commit", node: n}
	j.total.Store(img.Size())
	j.finalize = func(ctx context.Context) error {
		backing := cmp.Or(o.BackingFile, l.base.path)
		var err error
		if l.above == img {
			err = setter.SetBacking(ctx, backing, l.base.format())
		} else {
			err = e.setLayerBacking(ctx, l.above.Info(), backing, l.base.format())
		}
		if err != nil {
			return err
		}
		return e.reopenChain(n)
	}
	err = e.startJob(j, func(ctx context.Context, j *job) error {
		defer bo.Image.Close()
		err := commit.Commit(ctx, l.top, bo.Image, l.depth, commit.Options{Rate: j.Speed, Progress: func(done, total int64) {
			if total > 0 {
				j.cur.Store(j.total.Load() * done / total)
			}
		}})
		if err == nil {
			err = bo.Image.Flush(context.WithoutCancel(ctx))
		}
		return err
	})
	if err != nil {
		bo.Image.Close() // no job: nothing else will
	}
	return err
}

// commitLayerFiles turns block-commit's top-node and base-node into the
// file names of the layers they name (top "": the node's own image),
// refused in QEMU's words where they are not in the chain, top's first.
func (e *Engine) commitLayerFiles(n *node, img formats.Image, top, base, topNode, baseNode string) (string, string, error) {
	topDepth := 0
	switch {
	case topNode != "":
		d, err := e.chainDepth(n, topNode)
		if err != nil {
			return "", "", err
		}
		if d < 0 {
			return "", "", genericf("'%s' is not in this backing file chain", topNode)
		}
		topDepth, top = d, ""
		if d > 0 {
			top = layerAt(img, d).img.Info().Filename
		}
	case top != "" && img != nil:
		l, ok := findLayer(img, top)
		if !ok {
			return "", "", genericf("Top image file %s not found", top)
		}
		topDepth = l.depth
	}
	if baseNode == "" {
		return top, base, nil
	}
	d, err := e.chainDepth(n, baseNode)
	switch {
	case err != nil:
		return "", "", err
	case d < topDepth:
		return "", "", genericf("'%s' is not in this backing file chain", baseNode)
	case d == topDepth:
		return "", "", genericf("cannot commit an image into itself")
	}
	return top, layerAt(img, d).img.Info().Filename, nil
}

// setLayerBacking changes the backing file a layer below a node names
// (the layer above a committed one): the node's chain holds it open
// read-only, so it is opened writable on its own, without its chain and
// without a lock, as QEMU reopens it read-write for the change.
func (e *Engine) setLayerBacking(ctx context.Context, layer formats.Info, backing, format string) error {
	o, err := registry.Open(layer.Filename, registry.Options{Format: cmpFormat(layer.Format), Writable: true, NoBacking: true,
		Backend: e.o.Backend, Logger: e.log})
	if err != nil {
		return fmt.Errorf("reopen %s read-write: %w", layer.Filename, err)
	}
	setter, ok := o.Image.(backingSetter)
	if !ok {
		o.Image.Close()
		return fmt.Errorf("%s cannot change its backing file: only qcow2 can", layer.Filename)
	}
	err = setter.SetBacking(ctx, backing, format)
	if cerr := o.Image.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("close %s: %w", layer.Filename, cerr)
	}
	return err
}

// reopenChain opens n's image again once a job changed its backing
// chain, so that the node reads through the new chain and holds no layer
// the job took out of it (its lock released, its file free to go), as
// QEMU's graph change leaves it; the node's exports go on with the new
// image (pivotImage). The old chain closes first: two writable opens of
// one qcow2 image at once would each keep its own metadata. An open with
// the locks that fails (someone took one meanwhile) is done again without
// them (under mu).
func (e *Engine) reopenChain(n *node) error {
	p, ok := n.img.(*pivotImage)
	if !ok || n.opened == nil {
		return nil
	}
	return p.swap(context.Background(), func() error {
		if err := p.img.Close(); err != nil {
			e.log.Warn("closing the old backing chain", "node-name", n.name, "err", err)
		}
		opened, err := e.openNodeImage(n.path, n.driver, !n.readOnly)
		if err != nil {
			p.img, n.opened = goneImage{err}, nil
			return err
		}
		p.img, n.opened = opened.Image, opened
		e.nameLayers(n)
		return nil
	})
}

// openNodeImage opens a node's image with its locks, or without them
// when that fails (someone took one while a job changed the graph).
func (e *Engine) openNodeImage(path, format string, writable bool) (*registry.Opened, error) {
	o := registry.Options{Format: format, Writable: writable, Lock: true, Backend: e.o.Backend, Logger: e.log}
	opened, err := registry.Open(path, o)
	if err != nil {
		e.log.Warn("opening the node's image without its locks", "file", path, "err", err)
		o.Lock = false
		opened, err = registry.Open(path, o)
	}
	if err != nil {
		return nil, fmt.Errorf("reopen %s after the job's graph change: %w", path, err)
	}
	return opened, nil
}

// chainDepth finds the node name names in n's backing chain, as a job
// takes base-node, top-node and bottom: 0 is n itself, i the layer i
// below its image, -1 a node outside the chain (another node, a layer
// of another node's chain, a layer's file node). A name no node has is
// refused as QEMU's lookup refuses it (under mu).
func (e *Engine) chainDepth(n *node, name string) (int, error) {
	if name == n.name {
		return 0, nil
	}
	if i := slices.IndexFunc(n.layers, func(l layerNames) bool { return l.format == name }); i >= 0 {
		return i + 1, nil
	}
	if ref := n.backingRef; ref != nil {
		// The given backing node's chain is the rest of n's.
		if d, err := e.chainDepth(ref, name); err == nil && d >= 0 {
			return 1 + d, nil
		}
	}
	if e.node(name) != nil || e.layerOwner(name) != nil {
		return -1, nil
	}
	return 0, genericf("Cannot find device='' nor node-name='%s'", name)
}

// layerAt is the layer depth below img (the zero chainLayer where the
// chain is not that deep).
func layerAt(img formats.Image, depth int) chainLayer {
	above := img
	for d := 1; d <= depth; d++ {
		next, ok := findBacking(above)
		if !ok {
			return chainLayer{}
		}
		if d == depth {
			return chainLayer{depth: d, img: next, above: above, path: above.Info().FullBackingFilename}
		}
		above = next
	}
	return chainLayer{}
}

// chainLayer is one layer below a node's image.
type chainLayer struct {
	// depth below the node's image: 1 its backing file (0: no layer).
	depth int
	img   formats.Image
	// above is the layer whose backing file this is.
	above formats.Image
	// path is the layer's file as the layer above resolves its name.
	path string
}

// format is the layer's format by QEMU's driver name, which QEMU writes
// beside a backing file name it sets.
func (l chainLayer) format() string { return l.img.Info().Format }

// findLayer finds the layer of img's chain that name names (a file name,
// relative to the directory of the layer above, as QEMU's
// bdrv_find_backing_image takes it).
func findLayer(img formats.Image, name string) (chainLayer, bool) {
	for layer, depth := img, 1; ; depth++ {
		l, ok := layer.(formats.Layered)
		if !ok || l.Backing() == nil {
			return chainLayer{}, false
		}
		info := layer.Info()
		if commit.NamesFile(info.Filename, name, info.FullBackingFilename) {
			return chainLayer{depth: depth, img: l.Backing(), above: layer, path: info.FullBackingFilename}, true
		}
		layer = l.Backing()
	}
}

type backingSetter interface {
	SetBacking(ctx context.Context, backing, format string) error
}

func cmpFormat(f string) string {
	if f == "" {
		return registry.Auto
	}
	return f
}

// commitLayers are the layers a commit works on.
type commitLayers struct {
	// top is the layer committed, above the layer above it, whose
	// backing file changes.
	top, above formats.Image
	base       chainLayer
	// depth is the base's depth below top.
	depth int
}

// findCommitLayers finds top in img's chain and the base below it (base
// "": the bottom of the chain, as QEMU defaults).
func findCommitLayers(img formats.Image, top, base string) (commitLayers, error) {
	t, ok := findLayer(img, top)
	if !ok {
		return commitLayers{}, genericf("Top image file %s not found", top)
	}
	var b chainLayer
	if base != "" {
		if b, ok = findLayer(t.img, base); !ok {
			return commitLayers{}, genericf("Can't find '%s' in the backing chain", base)
		}
	} else {
		for layer := t.img; ; {
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
		return commitLayers{}, genericf("cannot commit an image into itself")
	}
	return commitLayers{top: t.img, above: t.above, base: b, depth: b.depth}, nil
}

// findBacking is img's backing image, if it has one.
func findBacking(img formats.Image) (formats.Image, bool) {
	l, ok := img.(formats.Layered)
	if !ok || l.Backing() == nil {
		return nil, false
	}
	return l.Backing(), true
}

// stopJobs cancels every job and waits for its work to end, so that the
// nodes close with no copy in flight (under mu: the jobs' ends wait on
// it, their events come after).
func (e *Engine) stopJobs() {
	for _, j := range e.jobs {
		j.cancel()
		<-j.worked
		if j.cleanup != nil && j.status != "concluded" {
			j.cleanup()
		}
	}
}
