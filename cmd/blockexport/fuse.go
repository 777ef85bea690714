package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/export/engine"
	fuseexport "github.com/blockexport/blockexport/export/fuse"
	"github.com/blockexport/blockexport/formats/protocols/nbd"
	"github.com/blockexport/blockexport/formats/registry"
)

type fuseFlags struct {
	serveFlags
	growable    bool
	allowOther  string
	queues      int
	pollUs      int
	adaptPoll   bool
	mappedReads bool
	stats       time.Duration
	fileName    string
	parts       partitionFlags
	kernelCache string
	readAhead   string
}

func fuseCommand() *cobra.Command {
	var f fuseFlags
	c := &cobra.Command{
		Use:   "fuse [flags] IMAGE MOUNTPOINT",
		Short: "export an image as a regular file through FUSE",
		Long: "Export IMAGE (an image file: " + imageFormats() + ";\n" +
			"null:SIZE; an object in HTTP(S) or S3 storage: http://..., https://...,\n" +
			"s3://BUCKET/KEY, read-only; or an NBD URI: nbd://HOST[:PORT]/EXPORT,\n" +
			"nbd+unix:///EXPORT?socket=PATH, nbds://... for TLS) as the regular file MOUNTPOINT.\n" +
			"MOUNTPOINT is created if missing and may be IMAGE itself. With --file-name NAME,\n" +
			"MOUNTPOINT is an existing directory instead, and the export is the one file\n" +
			"MOUNTPOINT/NAME in it.",
		Example: "  blockexport fuse -f qcow2 -w disk.qcow2 /tmp/disk.raw\n" +
			"  blockexport fuse null:1G /tmp/null\n" +
			"  blockexport fuse --file-name disk.img -w disk.qcow2 /mnt/export",
		RunE: f.run,
	}
	fs := c.Flags()
	f.register(c)
	fs.BoolVar(&f.growable, "growable", false, "writes past the end grow the image instead of failing")
	fs.StringVar(&f.allowOther, "allow-other", "auto", "let other users access the export: auto (try, fall back), on or off")
	fs.StringVar(&f.fileName, "file-name", "", "MOUNTPOINT is a directory: export the image as the one file NAME in it (without: MOUNTPOINT is the file)")
	fs.IntVar(&f.queues, "queues", 1, "/dev/fuse queues, each served by its own thread (more only helps with more cores)")
	fs.IntVar(&f.pollUs, "poll-us", 0, "busy-poll /dev/fuse this many microseconds after each request before sleeping (lower latency at queue depth 1, costs a core)")
	fs.BoolVar(&f.mappedReads, "mapped-reads", true, "reads of an image's pages that are in the host's page cache are replied straight from a read-only mapping of the image file (one writev instead of a pread and a writev), and reads of a remote object from its cached blocks; false: always read into a buffer first")
	fs.BoolVar(&f.adaptPoll, "adaptive-poll", true, "with --poll-us 0: spin up to 20 microseconds for the next request while the reader seems to wait on each reply (queue depth 1), as QEMU's adaptive polling; false: always sleep")
	fs.StringVar(&f.kernelCache, "kernel-cache", "auto", "let the kernel cache the export (page cache, read-ahead, writeback cache for buffered opens; O_DIRECT opens bypass it): on, off or auto (on for a local raw or qcow2 image with --cache writeback; off for null, NBD sources and --cache none). Turn it off when something besides this export writes the image (a raw image shared with a VM): the cache would not see those writes")
	fs.StringVar(&f.readAhead, "read-ahead", "auto", "with the kernel cache on: how far the kernel reads ahead of a sequential reader of the export (e.g. 4M); auto: as far as the device holding the image file reads ahead, at least 1M")
	f.parts.register(c, "with --file-name: one more file per partition of the image's MBR or GPT beside NAME, NAME-p1, NAME-p2... numbered as Linux numbers them")
	fs.DurationVar(&f.stats, "stats", 0, "log IOPS, bandwidth and latency percentiles per request kind every INTERVAL (e.g. 1s), and a summary at exit")
	f.registerTLS(c, "")
	completeWords(c, "allow-other", "auto", "on", "off")
	completeWords(c, "kernel-cache", "auto", "on", "off")
	return c
}

func (f *fuseFlags) run(c *cobra.Command, args []string) error {
	if len(args) != 2 {
		return usagef("fuse: want IMAGE and MOUNTPOINT, got %d argument(s) (see blockexport fuse --help)", len(args))
	}
	image, mountpoint := args[0], args[1]

	logger, opts, err := f.check()
	if err != nil {
		return err
	}
	mo, readAheadKB, err := f.mountOptions(c)
	if err != nil {
		return err
	}
	if f.daemonize && !isDaemonChild() {
		return daemonize(os.Args)
	}
	img, err := f.open(image, opts)
	if err != nil {
		return err
	}
	defer img.Image.Close()
	if img.Probed && img.Format == registry.Raw && f.writable {
		logger.Warn("image format was not given and probing guessed raw; a guest could write a qcow2 header into it. Pass --format raw to make this explicit", "image", registry.Shown(image))
	}

	served, parts, err := f.parts.apply(context.Background(), img.Image, image, f.fileName+"-", logger)
	if err != nil {
		return err
	}
	extra := make([]fuseexport.ExtraFile, len(parts))
	for i, p := range parts {
		extra[i] = fuseexport.ExtraFile{Name: p.name, Image: p.img}
	}
	expOpts := fuseexport.Tune(fuseexport.Options{Writable: f.writable, Growable: f.growable, Logger: logger,
		NoPageLend: !f.mappedReads, ReadAheadKB: f.readAheadKB(readAheadKB, image)},
		fuseexport.Served{KernelCache: f.kernelCache, Raw: img.Format == registry.Raw, QCOW2: img.Format == registry.QCOW2,
			Null: img.Format == registry.Null, NBD: nbd.IsURI(image), MayStall: served.Features().MayStall,
			Direct: f.cache == "none", Files: 1 + len(parts), Hosts: img.Hosts}, logger)
	sigs, jobs, stop, err := f.begin()
	if err != nil {
		return err
	}
	defer stop()
	var stats *fuseexport.Stats
	if f.stats > 0 {
		stats = fuseexport.NewStats()
	}
	mo.FsName, mo.Stats, mo.Extra = registry.Shown(image), stats, extra
	// One engine, one node, one export: the daemon's add and delete path
	// mounts, serves and unmounts it. The engine borrows the image: it is
	// flushed and closed here, after the engine is closed.
	eng := engine.NewOneShot(logger)
	defer eng.Close()
	if err := eng.AddImageNode(served, engine.ImageNode{NodeName: oneShotNode, Driver: img.Format,
		Filename: registry.Shown(image), ReadOnly: !f.writable}); err != nil {
		return err
	}
	if err := eng.AddExport(engine.ExportOptions{Type: "fuse", ID: oneShotExport, NodeName: oneShotNode,
		Writable: f.writable, Growable: f.growable, Mountpoint: mountpoint,
		FUSE: &engine.FUSEExtras{Export: expOpts, Mount: mo}}); err != nil {
		return err
	}
	m := eng.FUSEMount(oneShotExport)
	jobs.add(m.Abandon)
	fuseexport.OneProcForOneLoop(m, logger)
	// A server of block I/O must not wait on the page cache of the device it
	// serves: tell the kernel, as userspace block servers do. (After the
	// mount, so that a refused export still says one line.) Refused, it
	// matters only to a loop device on the export, which we cannot know
	// of: a debug line, not one on every unprivileged start.
	if err := unix.Prctl(unix.PR_SET_IO_FLUSHER, 1, 0, 0, 0); err != nil {
		logger.Debug("not marked as an I/O flusher (PR_SET_IO_FLUSHER needs CAP_SYS_RESOURCE): a loop device on this export may stall under memory pressure", "err", err)
	}
	if stats != nil {
		stopStats := make(chan struct{})
		statsDone := make(chan struct{})
		go func() { stats.Run(logger, f.stats, stopStats); close(statsDone) }()
		defer func() { close(stopStats); <-statsDone }()
	}
	logger.Info("exporting", "image", registry.Shown(image), "format", img.Format, "size", img.Image.Size(),
		"mountpoint", m.Path(), "file", m.File(), "writable", f.writable, "growable", f.growable,
		"kernel_cache", expOpts.KernelCache)
	notifyReady()

	select {
	case s := <-sigs:
		stopping(logger, s, sigs, jobs)
		if err := eng.EndExport(oneShotExport); err != nil {
			return err
		}
	case <-m.Done():
		logger.Info("unmounted from outside", "mountpoint", m.Path())
		// Nothing to unmount: the engine lets the export and its node go
		// and removes a mountpoint file the mount made.
		if err := eng.EndExport(oneShotExport); err != nil {
			return err
		}
	}
	if err := img.Image.Flush(context.Background()); err != nil {
		return fmt.Errorf("final flush: %w", err)
	}
	return nil
}

// oneShotNode and oneShotExport name the one node and the one export of
// a one-shot command's engine.
const (
	oneShotNode   = "image"
	oneShotExport = "export"
)

// readAheadKB resolves --read-ahead: a size given, or auto: as far as
// the device holding a local image reads ahead, and never less than one
// maximal READ (1 MiB). The export is then read ahead as the image file
// itself would be (this machine's disk: 16 MiB), instead of at the
// kernel's 128 KiB FUSE default.
func (f *fuseFlags) readAheadKB(given int, image string) int {
	if given > 0 {
		return given
	}
	kb := fuseexport.MinReadAheadKB
	if dev, ok := fuseexport.DeviceReadAheadKB(image); ok {
		kb = max(kb, dev)
	}
	return kb
}

// mountOptions checks the flags that say how to mount and serve, and
// returns the mount's options and the read-ahead asked for (0: auto).
func (f *fuseFlags) mountOptions(c *cobra.Command) (fuseexport.MountOptions, int, error) {
	allowOther, err := fuseexport.ParseAllowOther(f.allowOther)
	if err != nil {
		return fuseexport.MountOptions{}, 0, usageError{err}
	}
	if f.stats < 0 {
		return fuseexport.MountOptions{}, 0, usagef("--stats %v: want a positive interval", f.stats)
	}
	pollFor, err := pollDuration(f.pollUs)
	if err != nil {
		return fuseexport.MountOptions{}, 0, err
	}
	if f.queues < 1 || f.queues > 64 {
		return fuseexport.MountOptions{}, 0, usagef("--queues %d: want 1 to 64", f.queues)
	}
	if f.growable && !f.writable {
		return fuseexport.MountOptions{}, 0, usagef("--growable needs --writable")
	}
	if err := f.parts.check(c); err != nil {
		return fuseexport.MountOptions{}, 0, err
	}
	if f.parts.all && f.fileName == "" {
		return fuseexport.MountOptions{}, 0, usagef("--partitions adds files beside the disk's: it needs --file-name NAME (or --partition N alone)")
	}
	if f.parts.all && f.kernelCache == "on" {
		return fuseexport.MountOptions{}, 0, usagef("--kernel-cache on serves one file; --partitions serves several over the same bytes, each of which would not see the others' cached writes: drop one")
	}
	if (f.parts.all || f.parts.one > 0) && f.growable {
		return fuseexport.MountOptions{}, 0, usagef("--growable and --partition(s): a partition's size is the partition table's")
	}
	switch f.kernelCache {
	case "auto", "on", "off":
	default:
		return fuseexport.MountOptions{}, 0, usagef("unknown --kernel-cache mode %q (want auto, on or off)", f.kernelCache)
	}
	readAheadKB := 0 // auto
	if f.readAhead != "auto" {
		n, err := registry.ParseSize(f.readAhead)
		if err != nil || n < 4096 || n > 1<<30 {
			return fuseexport.MountOptions{}, 0, usagef("--read-ahead %q: want auto or a size from 4K to 1G", f.readAhead)
		}
		readAheadKB = int(n / 1024)
	}
	if c.Flags().Changed("file-name") {
		if err := fuseexport.CheckFileName(f.fileName); err != nil {
			return fuseexport.MountOptions{}, 0, usageError{err}
		}
	}
	return fuseexport.MountOptions{AllowOther: allowOther, Queues: f.queues, PollFor: pollFor, NoPace: !f.adaptPoll,
		FileName: f.fileName}, readAheadKB, nil
}
