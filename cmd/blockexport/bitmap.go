package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/registry"
)

// bitmapAction is one of bitmap's operation flags, in command-line order.
type bitmapAction struct {
	op     string // add, remove, clear, enable, disable, merge
	source string // merge: the source bitmap
}

// bitmapActionFlag is an operation flag: each use appends to the shared,
// ordered list (pflag keeps no order across flags).
type bitmapActionFlag struct {
	op      string
	actions *[]bitmapAction
	takes   bool // --merge takes the source bitmap's name
}

// String is the default pflag records: false for the operations that
// take no value, so that help and man pages show them as the booleans
// they look like.
func (f *bitmapActionFlag) String() string {
	if f.takes {
		return ""
	}
	return "false"
}
func (f *bitmapActionFlag) Type() string {
	if f.takes {
		return "SOURCE"
	}
	return "bool"
}
func (f *bitmapActionFlag) Set(v string) error {
	a := bitmapAction{op: f.op}
	if f.takes {
		a.source = v
	} else if on, err := strconv.ParseBool(v); err != nil {
		return fmt.Errorf("--%s=%s: want true or false", f.op, v)
	} else if !on {
		return nil // --add=false: no operation
	}
	*f.actions = append(*f.actions, a)
	return nil
}

type bitmapFlags struct {
	actions     []bitmapAction
	format      string
	source      string
	sourceFmt   string
	granularity string
	objects     []string
}

func bitmapCommand() *cobra.Command {
	var f bitmapFlags
	c := &cobra.Command{
		Use:   "bitmap (--merge SOURCE | --add | --remove | --clear | --enable | --disable)... [-b SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] [-f FMT] FILENAME BITMAP",
		Short: "add, remove, clear, enable, disable or merge a qcow2 persistent dirty bitmap, as qemu-img bitmap",
		Long: "Change the persistent dirty bitmap BITMAP of the qcow2 image FILENAME, as qemu-img bitmap\n" +
			"does: the operations run in the order given; --add makes an empty bitmap (granularity\n" +
			"-g, by default the cluster size within 4 KiB to 64 KiB; enabled unless --disable\n" +
			"follows); --merge SOURCE sets in BITMAP what bitmap SOURCE of this image (or of\n" +
			"SOURCE_FILE, -b) marks. The changes are written at once, after the operations: new\n" +
			"clusters first, durable before the header points at them, the old ones freed after, so\n" +
			"a crash leaves the bitmaps as before or as after. The image is locked as QEMU locks it.\n\n" +
			"Exit status, as qemu-img bitmap's: 0 success, 1 an error (an operation refused: the\n" +
			"operations before it are kept, as qemu-img keeps them).",
		Example: "  blockexport bitmap --add disk.qcow2 backup0\n" +
			"  blockexport bitmap --add -g 1M --disable disk.qcow2 frozen\n" +
			"  blockexport bitmap --merge backup0 -b old.qcow2 --clear disk.qcow2 backup1",
		RunE: func(c *cobra.Command, args []string) error { return f.run(c, args) },
	}
	fs := c.Flags()
	for _, a := range []struct{ op, usage string }{
		{"add", "add BITMAP (empty; -g its granularity)"},
		{"remove", "remove BITMAP"},
		{"clear", "clear every bit of BITMAP"},
		{"enable", "make BITMAP track writes"},
		{"disable", "make BITMAP stop tracking writes"},
	} {
		fl := fs.VarPF(&bitmapActionFlag{op: a.op, actions: &f.actions}, a.op, "", a.usage)
		fl.NoOptDefVal = "true"
	}
	fs.Var(&bitmapActionFlag{op: "merge", actions: &f.actions, takes: true}, "merge", "set in BITMAP the bits of bitmap SOURCE (of this image, or of -b SOURCE_FILE)")
	fs.StringVarP(&f.source, "source-file", "b", "", "the image holding --merge's SOURCE bitmap")
	fs.StringVarP(&f.sourceFmt, "source-format", "F", "", "SOURCE_FILE's format (default: probed)")
	fs.StringVarP(&f.granularity, "granularity", "g", "", "--add's granularity in bytes (a power of 2, at least 512; k, M, G suffixes)")
	fs.StringVarP(&f.format, "format", "f", "", "FILENAME's format (default: probed)")
	fs.StringArrayVar(&f.objects, "object", nil, "accepted for qemu-img's command lines; no object is used")
	completeWords(c, "format", registry.FileFormats()...)
	completeWords(c, "source-format", registry.FileFormats()...)
	return c
}

// run checks the command line as qemu-img bitmap does (its errors exit
// 1, not 2, as there), opens the images and applies the operations.
func (f *bitmapFlags) run(c *cobra.Command, args []string) error {
	add := false
	merge := false
	for _, a := range f.actions {
		add = add || a.op == "add"
		merge = merge || a.op == "merge"
	}
	granularity := int64(0)
	if f.granularity != "" {
		g, err := parseQemuSize(f.granularity)
		if err != nil {
			return errors.New("Invalid granularity specified. You may use k, M, G, T, P or E suffixes for\nkilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.")
		}
		granularity = g
	}
	switch {
	case len(f.actions) == 0:
		return errors.New("Need at least one of --add, --remove, --clear, --enable, --disable, or --merge")
	case granularity != 0 && !add:
		return errors.New("granularity only supported with --add")
	case f.sourceFmt != "" && f.source == "":
		return errors.New("-F only supported with -b")
	case f.source != "" && !merge:
		return errors.New("Merge bitmap source file only supported with --merge")
	case len(args) != 2:
		return errors.New("Expecting filename and bitmap name")
	}
	filename, name := args[0], args[1]
	ctx := context.Background()
	logger := warnLogger(c.ErrOrStderr())
	img, err := openForBitmaps(filename, registry.Options{Lock: true, Format: f.format, Writable: true, EditBitmaps: true,
		Backend: "threads", Logger: logger})
	if err != nil {
		return err
	}
	closed := false
	defer func() {
		if !closed {
			img.Image.Close()
		}
	}()
	var src *registry.Opened
	if f.source != "" {
		if src, err = openForBitmaps(f.source, registry.Options{Lock: true, Format: f.sourceFmt, Backend: "threads", Logger: logger}); err != nil {
			return err
		}
		defer src.Image.Close()
	}
	q, ok := img.Image.(*qcow2.Image)
	if !ok {
		return bitmapsUnsupported(f.actions, filename, name)
	}
	edit, err := q.EditBitmaps(ctx)
	if err != nil {
		return err
	}
	var srcImage *qcow2.Image
	if src != nil {
		srcImage, _ = src.Image.(*qcow2.Image)
	}
	opErr := f.apply(ctx, edit, name, granularity, src != nil, srcImage)
	// What was applied before a refused operation is kept, as qemu-img
	// stores its bitmaps at close whatever happened.
	if err := edit.Commit(ctx); err != nil {
		return fmt.Errorf("%s: write the bitmaps: %w", filename, err)
	}
	closed = true
	if err := img.Image.Close(); err != nil {
		return fmt.Errorf("%s: %w", filename, err)
	}
	return opErr
}

// apply runs the operations in order and stops at the first refused,
// worded as qemu-img words it.
func (f *bitmapFlags) apply(ctx context.Context, edit *qcow2.BitmapEdit, name string, granularity int64, fromFile bool, src *qcow2.Image) error {
	for _, a := range f.actions {
		var err error
		switch a.op {
		case "add":
			// qemu-img hands the granularity on as a uint32: one given
			// that truncates to 0 is refused, not the default.
			g := int64(uint32(granularity))
			if granularity != 0 && g == 0 {
				g = -1
			}
			disabled := false // --disable is an operation of its own, as there
			err = edit.Add(name, g, disabled)
		case "remove":
			err = edit.Remove(name)
		case "clear":
			err = edit.Clear(name)
		case "enable":
			err = edit.Enable(name)
		case "disable":
			err = edit.Disable(name)
		case "merge":
			switch {
			case fromFile && src == nil:
				// the destination is checked first, as there
				if lerr := edit.CheckUsable(name); lerr != nil {
					err = lerr
				} else {
					err = fmt.Errorf("Dirty bitmap '%s' not found", a.source)
				}
			default:
				err = edit.Merge(ctx, name, src, a.source)
			}
		}
		if err != nil {
			return fmt.Errorf("Operation %s on bitmap %s failed: %w", a.op, name, err)
		}
	}
	return nil
}

// bitmapsUnsupported is qemu-img's answer for an image format that keeps
// no bitmaps: nothing to find, nowhere to add.
func bitmapsUnsupported(actions []bitmapAction, filename, name string) error {
	a := actions[0]
	if a.op == "add" {
		return fmt.Errorf("Operation add on bitmap %s failed: Can't store persistent bitmaps to %s: Operation not supported", name, filename)
	}
	return fmt.Errorf("Operation %s on bitmap %s failed: Dirty bitmap '%s' not found", a.op, name, name)
}

// openForBitmaps opens an image as qemu-img would, with its messages for
// a locked image and any other failure.
func openForBitmaps(spec string, o registry.Options) (*registry.Opened, error) {
	img, err := registry.Open(spec, o)
	switch {
	case err == nil:
		return img, nil
	case errors.Is(err, aio.ErrInUse):
		lock := `"write"` // the permission we want and another holder does not share
		if !o.Writable {
			lock = `shared "write"` // we share no writer, and another holds write
		}
		return nil, fmt.Errorf("Could not open '%s': Failed to get %s lock\nIs another process using the image [%s]?", spec, lock, spec)
	case errors.Is(err, registry.ErrBadSpec):
		return nil, fmt.Errorf("Could not open '%s': %w", spec, err)
	}
	return nil, fmt.Errorf("Could not open '%s': %w", spec, err)
}

// parseQemuSize parses a size as qemu-img's cvtnum: a number, possibly
// with a fraction, then an optional suffix (b, k, M, G, T, P, E; bytes
// without one).
func parseQemuSize(s string) (int64, error) {
	num := strings.TrimRight(s, "bBkKmMgGtTpPeE")
	suffix := s[len(num):]
	if len(suffix) > 1 || num == "" {
		return 0, fmt.Errorf("invalid size %q", s)
	}
	mult := float64(1)
	if suffix != "" {
		mult = math.Pow(1024, float64(strings.IndexByte("bkmgtpe", strings.ToLower(suffix)[0])))
	}
	if strings.ContainsAny(num, "+-eE") {
		return 0, fmt.Errorf("invalid size %q", s)
	}
	if mult == 1 {
		n, err := strconv.ParseUint(num, 10, 63)
		if err != nil {
			return 0, fmt.Errorf("invalid size %q", s)
		}
		return int64(n), nil
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || v < 0 || v*mult >= math.MaxInt64 {
		return 0, fmt.Errorf("invalid size %q", s)
	}
	return int64(v * mult), nil
}
