package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/registry"
)

// snapshotter is an image with internal snapshots (qcow2).
type snapshotter interface {
	Snapshots() []formats.Snapshot
	CreateSnapshot(ctx context.Context, name string, now time.Time) error
	ApplySnapshot(ctx context.Context, idOrName string) error
	DeleteSnapshot(ctx context.Context, name string) error
}

func snapshotCommand() *cobra.Command {
	var format, create, apply, del string
	var list, quiet, forceShare bool
	c := &cobra.Command{
		Use:   "snapshot [flags] -l|-c NAME|-a NAME|-d NAME IMAGE",
		Short: "list, create, apply or delete a qcow2 image's internal snapshots, as qemu-img snapshot",
		Long: "List (-l), create (-c), apply (-a, by ID or name) or delete (-d, by name) the internal\n" +
			"snapshots of a qcow2 image, as qemu-img snapshot does, under QEMU's image locks. Each\n" +
			"change is written in an order that leaves the image consistent if it is interrupted\n" +
			"(clusters may leak). Exit status 0, or 1 on any error, as qemu-img's.",
		Example: "  blockexport snapshot -c before-upgrade disk.qcow2\n" +
			"  blockexport snapshot -l disk.qcow2",
	}
	c.Flags().BoolVarP(&list, "list", "l", false, "list the snapshots")
	c.Flags().StringVarP(&create, "create", "c", "", "create a snapshot named `NAME` of the current state")
	c.Flags().StringVarP(&apply, "apply", "a", "", "revert the image to the snapshot with ID or name `NAME`")
	c.Flags().StringVarP(&del, "delete", "d", "", "delete the snapshot named `NAME`")
	c.Flags().BoolVarP(&quiet, "quiet", "q", false, "print nothing but errors")
	c.Flags().BoolVarP(&forceShare, "force-share", "U", false, "with -l: list an image that another process writes (no locks taken)")
	formatFlag(c, &format, formatUsage)
	// qemu-img exits 1 on a usage error, as on any other.
	c.SetFlagErrorFunc(func(c *cobra.Command, err error) error { return snapshotStatus(c.ErrOrStderr(), usageError{err}) })
	c.RunE = func(c *cobra.Command, args []string) error {
		ops := 0
		for _, set := range []bool{list, c.Flags().Changed("create"), c.Flags().Changed("apply"), c.Flags().Changed("delete")} {
			if set {
				ops++
			}
		}
		switch {
		case ops > 1:
			return snapshotStatus(c.ErrOrStderr(), usagef("Cannot mix '-l', '-a', '-c', '-d'"))
		case len(args) != 1:
			return snapshotStatus(c.ErrOrStderr(), usagef("snapshot: want one IMAGE, got %d argument(s)", len(args)))
		case ops == 0:
			// qemu-img opens the image and does nothing: so do we.
			list = true
			c.SetOut(io.Discard)
		}
		err := snapshot(c.OutOrStdout(), args[0], format, list, forceShare, create, apply, del, c.Flags())
		return snapshotStatus(c.ErrOrStderr(), err)
	}
	return c
}

// snapshotStatus says err in one line and exits 1, as qemu-img snapshot.
func snapshotStatus(stderr io.Writer, err error) error {
	if err == nil {
		return nil
	}
	fmt.Fprintf(stderr, "blockexport: %v\n", err)
	return exitStatus(1)
}

type flagSet interface{ Changed(string) bool }

// snapshot runs one snapshot operation on image.
func snapshot(stdout io.Writer, image, format string, list, forceShare bool, create, apply, del string, fl flagSet) error {
	if _, err := registry.ParseFormat(format); err != nil {
		return usageError{err}
	}
	if forceShare && !list {
		return fmt.Errorf("Could not open '%s': force-share=on can only be used with read-only images", image)
	}
	o := registry.Options{Format: format, Lock: !forceShare, Writable: !list, NoBacking: true, Backend: "threads", Logger: warnLogger(os.Stderr)}
	op, name := "", ""
	switch {
	case fl.Changed("create"):
		op, name = "create", create
	case fl.Changed("apply"):
		op, name = "apply", apply
	case fl.Changed("delete"):
		op, name = "delete", del
	}
	opened, err := registry.Open(image, o)
	if err != nil {
		return fmt.Errorf("Could not open '%s': %w", image, err)
	}
	img := opened.Image
	s, ok := img.(snapshotter)
	if list {
		defer img.Close()
		if ok {
			if snaps := s.Snapshots(); len(snaps) > 0 {
				fmt.Fprintln(stdout, "Snapshot list:")
				printSnapshots(stdout, snaps)
			}
		}
		return nil
	}
	ctx := context.Background()
	switch {
	case !ok:
		err = errors.New("-95 (Operation not supported)")
	case op == "create":
		err = s.CreateSnapshot(ctx, name, time.Now())
	case op == "apply":
		err = s.ApplySnapshot(ctx, name)
		switch {
		case errors.Is(err, qcow2.ErrSnapshotNotFound):
			err = errors.New("Failed to load snapshot: No such file or directory")
		case errors.Is(err, qcow2.ErrActiveBitmaps):
			err = qcow2.ErrActiveBitmaps
		}
	case op == "delete":
		err = s.DeleteSnapshot(ctx, name)
		if errors.Is(err, qcow2.ErrSnapshotNotFound) {
			err = qcow2.ErrSnapshotNotFound
		}
	}
	if cerr := img.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("Could not %s snapshot '%s': %w", op, name, err)
	}
	return nil
}

// printSnapshots prints a snapshot table as qemu-img 7.2 does (its
// bdrv_snapshot_dump), for snapshot -l and info: dates in local time.
func printSnapshots(w io.Writer, snaps []formats.Snapshot) {
	fmt.Fprintf(w, "%-10s%-17s%8s%20s%13s%11s\n", "ID", "TAG", "VM SIZE", "DATE", "VM CLOCK", "ICOUNT")
	for _, s := range snaps {
		date := time.Unix(int64(s.DateSec), 0).Format("2006-01-02 15:04:05")
		clock := fmt.Sprintf("%02d:%02d:%02d.%03d", s.VMClockSec/3600, s.VMClockSec/60%60, s.VMClockSec%60, s.VMClockNsec/1e6)
		icount := ""
		if s.ICount != nil {
			icount = fmt.Sprint(int64(*s.ICount))
		}
		fmt.Fprintf(w, "%-9s %-16s %8s%20s%13s%11s\n", s.ID, s.Name, humanSize(int64(s.VMStateSize)), date, clock, icount)
	}
}
