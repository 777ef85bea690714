package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/registry"
)

// Exit statuses of check, qemu-img check's: 0 is a clean image.
const (
	checkIncomplete = 1 // the check could not finish (or hit internal errors), or a usage error
	checkCorrupt    = 2
	checkLeaks      = 3  // leaked clusters, and nothing worse
	checkNoChecks   = 63 // the format has no checks (raw, vpc, null, NBD) or repairs (vdi)
)

// exitStatus ends a command with a status and no message: check has
// printed its findings already.
type exitStatus int

func (e exitStatus) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

func checkCommand() *cobra.Command {
	var f inspectFlags
	var repair string
	c := &cobra.Command{
		Use:   "check [flags] IMAGE",
		Short: "check (and repair) an image's metadata, as qemu-img check does",
		Long: "Check IMAGE's metadata as qemu-img check does (qcow2: every refcount against the\n" +
			"references; the other formats as QEMU checks them). Exit status, as qemu-img check's:\n" +
			"0 clean, 2 corruptions, 3 leaked clusters only, 1 the check could not finish or a usage\n" +
			"error, 63 a format without checks (" + strings.Join(registry.UncheckedFormats(), ", ") + ", null, NBD) or repairs (vdi with -r).\n" +
			"-r leaks refuses a qcow2 image whose refcount structures must be rebuilt (exit 1, image\n" +
			"untouched); -r all rebuilds them in fresh clusters at the end. On a vhdx with a dirty\n" +
			"log, -r leaks or -r all replays the log, as QEMU's read-write open does.",
		Example: "  blockexport check disk.qcow2\n" +
			"  blockexport check -r all --output=json disk.qcow2",
	}
	c.Flags().StringVarP(&repair, "repair", "r", "", "repair: leaks (free leaked clusters) or all (also refcounts too low and COPIED flags); refused while anyone uses the image")
	f.register(c)
	completeWords(c, "repair", "leaks", "all")
	// qemu-img check exits 1 on a usage error, not 2 as the other
	// commands do; flag errors included.
	c.SetFlagErrorFunc(func(c *cobra.Command, err error) error { return checkStatus(c.ErrOrStderr(), usageError{err}) })
	c.RunE = func(c *cobra.Command, args []string) error {
		return checkStatus(c.ErrOrStderr(), check(c.OutOrStdout(), c.ErrOrStderr(), args, &f, repair))
	}
	return c
}

// checkStatus turns check's usage errors and formats without checks into
// qemu-img check's exit statuses, saying why.
func checkStatus(stderr io.Writer, err error) error {
	var u usageError
	switch {
	case errors.As(err, &u):
		fmt.Fprintf(stderr, "blockexport: %v\n", err)
		return exitStatus(checkIncomplete)
	case errors.Is(err, registry.ErrNoChecks):
		fmt.Fprintf(stderr, "blockexport: %v\n", err)
		return exitStatus(checkNoChecks)
	}
	return err
}

// check is the check command once its flags are parsed.
func check(stdout, stderr io.Writer, args []string, f *inspectFlags, repair string) error {
	if len(args) != 1 {
		return usagef("check: want one IMAGE, got %d argument(s)", len(args))
	}
	asJSON, err := f.out.json()
	if err != nil {
		return err
	}
	mode := qcow2.RepairNone
	switch repair {
	case "":
	case "leaks":
		mode = qcow2.RepairLeaks
	case "all":
		mode = qcow2.RepairAll
	default:
		return usagef("unknown --repair %q (want leaks or all)", repair)
	}
	o, err := f.options()
	if err != nil {
		return err
	}
	o.Lock = true // a check refuses an image someone writes, a repair one anybody uses
	res, err := registry.Check(context.Background(), args[0], o, mode)
	// What the check found before it failed is said too, as qemu-img
	// says it before "Check failed".
	for _, m := range res.Messages {
		fmt.Fprintln(stderr, m)
	}
	if err != nil {
		if errors.Is(err, registry.ErrBadSpec) {
			return usageError{err}
		}
		return fmt.Errorf("check: %w", err) // the error names the image
	}
	if asJSON {
		if err := writeQemuJSON(stdout, res); err != nil {
			return err
		}
	} else {
		printCheck(stdout, res)
	}
	switch {
	case res.CheckErrors > 0:
		return exitStatus(checkIncomplete)
	case res.Corruptions > 0:
		return exitStatus(checkCorrupt)
	case res.Leaks > 0:
		return exitStatus(checkLeaks)
	}
	return nil
}

// printCheck prints a check's findings in qemu-img check's words.
func printCheck(w io.Writer, r formats.CheckResult) {
	if r.LeaksFixed+r.CorruptionsFixed > 0 {
		fmt.Fprintf(w, "The following inconsistencies were found and repaired:\n\n    %d leaked clusters\n    %d corruptions\n\nDouble checking the fixed image now...\n",
			r.LeaksFixed, r.CorruptionsFixed)
	}
	if r.CheckErrors == 0 && r.Corruptions == 0 && r.Leaks == 0 {
		fmt.Fprintln(w, "No errors were found on the image.")
	}
	if r.Corruptions > 0 {
		fmt.Fprintf(w, "\n%d errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.\n", r.Corruptions)
	}
	if r.Leaks > 0 {
		fmt.Fprintf(w, "\n%d leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data.\n", r.Leaks)
	}
	if r.CheckErrors > 0 {
		fmt.Fprintf(w, "\n%d internal errors have occurred during the check.\n", r.CheckErrors)
	}
	if r.TotalClusters > 0 && r.AllocatedClusters > 0 {
		a := float64(r.AllocatedClusters)
		fmt.Fprintf(w, "%d/%d = %0.2f%% allocated, %0.2f%% fragmented, %0.2f%% compressed clusters\n",
			r.AllocatedClusters, r.TotalClusters, a*100/float64(r.TotalClusters),
			float64(r.FragmentedClusters)*100/a, float64(r.CompressedClusters)*100/a)
	}
	if r.ImageEndOffset > 0 {
		fmt.Fprintf(w, "Image end offset: %d\n", r.ImageEndOffset)
	}
}
