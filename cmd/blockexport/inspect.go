package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/jobs/progress"
	"github.com/blockexport/blockexport/formats/registry"
)

// inspectFlags are the flags of the commands that read an image and
// report on it (info, map, check).
type inspectFlags struct {
	format string
	out    outputFlag
	src    sourceFlags
}

func (f *inspectFlags) register(c *cobra.Command) {
	f.out.register(c, c.Name())
	formatFlag(c, &f.format, formatUsage)
	f.src.register(c)
	f.src.registerTLS(c, "")
}

// options are how to open the image: read-only, without locks (as
// qemu-img's --force-share), through threads.
func (f *inspectFlags) options() (registry.Options, error) {
	if _, err := registry.ParseFormat(f.format); err != nil {
		return registry.Options{}, usageError{err}
	}
	o, err := f.src.options()
	o.Format, o.NullReadZeroes, o.Backend, o.Logger = f.format, true, "threads", warnLogger(os.Stderr)
	return o, err
}

// warnLogger is the logger of the commands that report and exit: warnings
// (a file given as raw that looks like a vmdk, say) as plain lines on w,
// without the time a long-running export's log has.
func warnLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn, ReplaceAttr: dropTime}))
}

// dropTime leaves a record's time out (a slog.HandlerOptions.ReplaceAttr).
func dropTime(groups []string, a slog.Attr) slog.Attr {
	if len(groups) == 0 && a.Key == slog.TimeKey {
		return slog.Attr{}
	}
	return a
}

// outputFlag is --output human|json (qemu-img's spelling) with --json as
// its shorthand.
type outputFlag struct {
	output string
	asJSON bool
}

func (o *outputFlag) register(c *cobra.Command, cmd string) {
	c.Flags().StringVar(&o.output, "output", "human", "output format: human or json (JSON with qemu-img "+cmd+" --output=json's names)")
	c.Flags().BoolVar(&o.asJSON, "json", false, "the same as --output=json")
	completeWords(c, "output", "human", "json")
}

// json says whether JSON was asked for; an unknown --output is a usage
// error.
func (o *outputFlag) json() (bool, error) {
	switch o.output {
	case "human":
		return o.asJSON, nil
	case "json":
		return true, nil
	}
	return false, usagef("unknown --output %q (want human or json)", o.output)
}

// imageFormats says the image formats read here, for help, as the
// registry lists them: "qcow2, raw, or read-only vmdk, ...".
func imageFormats() string {
	if ro := registry.ReadOnlyFormats(); len(ro) > 0 {
		return strings.Join(registry.WritableFormats(), ", ") + ", or read-only " + strings.Join(ro, ", ")
	}
	return strings.Join(registry.WritableFormats(), ", ")
}

// imageHelp says what IMAGE may be, for the inspecting commands' help.
var imageHelp = "IMAGE is an image file (" + imageFormats() + "), null:SIZE,\n" +
	"an object in HTTP(S) or S3 storage (http://..., https://..., s3://BUCKET/KEY,\n" +
	"read-only), or an export on an NBD server: nbd://HOST[:PORT]/EXPORT,\n" +
	"nbd+unix:///EXPORT?socket=PATH, and nbds://... or nbds+unix://... for TLS (the\n" +
	"client's files: --tls-ca, --tls-cert, --tls-key)."

func infoCommand() *cobra.Command {
	var f inspectFlags
	var chain bool
	c := &cobra.Command{
		Use:   "info [flags] IMAGE",
		Short: "describe an image (format, sizes, backing chain, features)",
		Long: "Describe IMAGE as qemu-img info does; without --backing-chain no backing file\n" +
			"is opened, as in qemu-img.\n" + imageHelp,
		Example: "  blockexport info --output=json --backing-chain overlay.qcow2",
	}
	c.Flags().BoolVar(&chain, "backing-chain", false, "describe every image of the backing chain")
	f.register(c)
	c.RunE = func(c *cobra.Command, args []string) error {
		return info(c.OutOrStdout(), args, &f, chain)
	}
	return c
}

// info is the info command once its flags are parsed.
func info(stdout io.Writer, args []string, f *inspectFlags, chain bool) error {
	asJSON, err := f.out.json()
	if err != nil {
		return err
	}
	if len(args) != 1 {
		return usagef("info: want one IMAGE, got %d argument(s)", len(args))
	}
	o, err := f.options()
	if err != nil {
		return err
	}
	// qemu-img info opens no backing file unless asked for the chain: an
	// image whose backing file is missing is still described (and names
	// it), and no server a backing URI names is contacted.
	o.NoBacking = !chain
	img, err := openImage(args[0], o)
	if err != nil {
		return err
	}
	defer img.Image.Close()
	infos := []formats.Info{img.Image.Info()}
	if chain {
		for layer := img.Image; ; {
			l, ok := layer.(formats.Layered)
			if !ok || l.Backing() == nil {
				break
			}
			layer = l.Backing()
			infos = append(infos, layer.Info())
		}
	}
	if asJSON && chain {
		return writeQemuJSON(stdout, infos)
	}
	if asJSON {
		return writeQemuJSON(stdout, infos[0])
	}
	for i, info := range infos {
		if i > 0 {
			fmt.Fprintln(stdout)
		}
		printInfo(stdout, info)
	}
	if img.ProbeNote != "" {
		fmt.Fprintln(stdout, "note: "+img.ProbeNote)
	}
	return nil
}

func printInfo(w io.Writer, in formats.Info) {
	fmt.Fprintf(w, "image: %s\n", in.Filename)
	fmt.Fprintf(w, "file format: %s\n", in.Format)
	fmt.Fprintf(w, "virtual size: %s (%d bytes)\n", humanSize(in.VirtualSize), in.VirtualSize)
	switch {
	case in.ActualSize >= 0:
		fmt.Fprintf(w, "disk size: %s\n", humanSize(in.ActualSize))
	case in.Remote, in.ActualSize < 0:
		fmt.Fprintln(w, "disk size: unavailable")
	}
	if in.ClusterSize > 0 {
		fmt.Fprintf(w, "cluster_size: %d\n", in.ClusterSize)
	}
	if in.BackingFilename != "" {
		fmt.Fprintf(w, "backing file: %s", in.BackingFilename)
		if in.FullBackingFilename != in.BackingFilename {
			fmt.Fprintf(w, " (actual path: %s)", in.FullBackingFilename)
		}
		fmt.Fprintln(w)
		if in.BackingFilenameFormat != "" {
			fmt.Fprintf(w, "backing file format: %s\n", in.BackingFilenameFormat)
		}
	}
	if len(in.Snapshots) > 0 {
		fmt.Fprintln(w, "Snapshot list:")
		printSnapshots(w, in.Snapshots)
	}
	if fs := in.FormatSpecific; fs != nil {
		fmt.Fprintln(w, "Format specific information:")
		for _, l := range fs.Lines {
			fmt.Fprintln(w, "    "+l)
		}
	}
	if in.DirtyFlag {
		fmt.Fprintln(w, "dirty: yes (refcounts may be stale; qemu-img check -r all repairs)")
	}
	if len(in.ServerLines) > 0 {
		fmt.Fprintln(w, "NBD server:")
		for _, l := range in.ServerLines {
			fmt.Fprintln(w, l)
		}
	}
}

// humanSize prints bytes as qemu-img's size_to_str does: three
// significant digits, the unit switching up once the number reaches 1000
// (1000 bytes are "0.977 KiB", 1048575 "1 MiB").
func humanSize(n int64) string {
	_, exp := math.Frexp(float64(n) / (1000.0 / 1024.0))
	i := (exp - 1) / 10 // truncates toward zero, as C does: 0 stays in bytes
	return fmt.Sprintf("%.3g %sB", float64(n)/float64(uint64(1)<<(10*i)), [...]string{"", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"}[i])
}

// mapEntry is one extent of `blockexport map --json`, with the names and
// meaning of qemu-img map --output=json.
type mapEntry struct {
	Start   int64  `json:"start"`
	Length  int64  `json:"length"`
	Depth   int    `json:"depth"`
	Present bool   `json:"present"`
	Zero    bool   `json:"zero"`
	Data    bool   `json:"data"`
	Offset  *int64 `json:"offset,omitempty"`
	file    string
}

// mergeable says whether next continues e as qemu-img merges entries.
func (e *mapEntry) mergeable(next mapEntry) bool {
	if e.Depth != next.Depth || e.Present != next.Present || e.Zero != next.Zero || e.Data != next.Data || e.file != next.file {
		return false
	}
	if (e.Offset == nil) != (next.Offset == nil) {
		return false
	}
	return e.Offset == nil || *e.Offset+e.Length == *next.Offset
}

func mapCommand() *cobra.Command {
	var f inspectFlags
	c := &cobra.Command{
		Use:     "map [flags] IMAGE",
		Short:   "print an image's allocation, as qemu-img map does",
		Long:    "Print the allocation of IMAGE as qemu-img map does.\n" + imageHelp,
		Example: "  blockexport map --output=json disk.qcow2",
	}
	f.register(c)
	c.RunE = func(c *cobra.Command, args []string) error {
		return mapCmd(c.OutOrStdout(), c.ErrOrStderr(), args, &f)
	}
	return c
}

// mapCmd is the map command once its flags are parsed.
func mapCmd(stdout, stderr io.Writer, args []string, f *inspectFlags) error {
	asJSON, err := f.out.json()
	if err != nil {
		return err
	}
	if len(args) != 1 {
		return usagef("map: want one IMAGE, got %d argument(s)", len(args))
	}
	o, err := f.options()
	if err != nil {
		return err
	}
	img, err := openImage(args[0], o)
	if err != nil {
		return err
	}
	defer img.Image.Close()
	entries, err := mapImage(context.Background(), img.Image, progressTo(stderr))
	if err != nil {
		return err
	}
	if asJSON {
		return writeMapJSON(stdout, entries)
	}
	return writeMapHuman(stdout, entries)
}

// writeMapJSON prints the entries as qemu-img map --output=json does
// (qemu-img.c, dump_map_entry): one entry a line, "{ " and ", " spaced.
// An empty image is one entry of length 0, as qemu-img prints it.
func writeMapJSON(w io.Writer, entries []mapEntry) error {
	if len(entries) == 0 {
		entries = []mapEntry{{}}
	}
	var b strings.Builder
	b.WriteString("[")
	for i, e := range entries {
		if i > 0 {
			b.WriteString(",\n")
		}
		fmt.Fprintf(&b, `{ "start": %d, "length": %d, "depth": %d, "present": %t, "zero": %t, "data": %t`,
			e.Start, e.Length, e.Depth, e.Present, e.Zero, e.Data)
		if e.Offset != nil {
			fmt.Fprintf(&b, `, "offset": %d`, *e.Offset)
		}
		b.WriteString("}")
	}
	b.WriteString("]\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// errNoOffset is qemu-img map's refusal of data it cannot say where it
// lies (compressed clusters, a streamOptimized vmdk's grains).
var errNoOffset = errors.New("File contains external, encrypted or compressed clusters.")

// writeMapHuman prints the entries qemu-img map's human format shows:
// data that is not zeroes, where it lies. Data without an offset fails
// the map there, as in qemu-img (which has printed the lines before it);
// qemu-img counts an entry after the first that reads as zeroes as no
// data, so only the first may fail for being zero data without offset.
func writeMapHuman(w io.Writer, entries []mapEntry) error {
	fmt.Fprintf(w, "%-16s%-16s%-16s%s\n", "Offset", "Length", "Mapped to", "File")
	for i, e := range entries {
		data := e.Data && (i == 0 || !e.Zero)
		if data && e.Offset == nil {
			return errNoOffset
		}
		if data && !e.Zero {
			fmt.Fprintf(w, "%-16s%-16s%-16s%s\n", cHex(e.Start), cHex(e.Length), cHex(*e.Offset), e.file)
		}
	}
	return nil
}

// cHex formats like C's %#x, which prints zero as "0".
func cHex(v int64) string {
	if v == 0 {
		return "0"
	}
	return fmt.Sprintf("%#x", v)
}

// mapImage walks the image's extents and merges them.
func mapImage(ctx context.Context, img formats.Image, progress func(done, total int64)) ([]mapEntry, error) {
	var list []mapEntry
	size := img.Size()
	for off := int64(0); off < size; {
		e, err := img.Extent(ctx, off, size-off)
		if err != nil {
			return nil, err
		}
		if e.Length <= 0 {
			return nil, fmt.Errorf("map: empty extent at %d", off)
		}
		m := mapEntry{Start: e.Start, Length: e.Length, Depth: e.Depth, Present: e.Present, Zero: e.Zero, Data: e.Data, file: e.File}
		if e.HasOffset {
			o := e.Offset
			m.Offset = &o
		}
		if n := len(list); n > 0 && list[n-1].mergeable(m) {
			list[n-1].Length += m.Length
		} else {
			list = append(list, m)
		}
		off += e.Length
		progress(off, size)
	}
	progress(size, size)
	return padToSector(list, size), nil
}

// padToSector ends the map at a whole sector, as qemu-img's: QEMU sees a
// raw file of 1000 bytes as 1024, the 24 past its end a hole that reads
// as zeroes.
func padToSector(list []mapEntry, size int64) []mapEntry {
	n := len(list)
	pad := (512 - size%512) % 512
	if pad == 0 || n == 0 {
		return list
	}
	last := list[n-1]
	m := mapEntry{Start: size, Length: pad, Depth: last.Depth, Present: true, Zero: true, file: last.file}
	if last.Offset != nil {
		o := *last.Offset + last.Length
		m.Offset = &o
	}
	if last.mergeable(m) {
		list[n-1].Length += pad
		return list
	}
	return append(list, m)
}

// progressTo returns a progress reporter that draws a percentage on w when
// w is a terminal and the run has taken over a second; otherwise nothing.
func progressTo(w io.Writer) func(done, total int64) {
	if !progress.IsTerminal(w) {
		return func(int64, int64) {}
	}
	start, last, shown := time.Now(), time.Time{}, false
	return func(done, total int64) {
		now := time.Now()
		if done >= total {
			if shown {
				fmt.Fprint(w, "\r\033[K")
			}
			return
		}
		if now.Sub(start) < time.Second || now.Sub(last) < 100*time.Millisecond {
			return
		}
		last, shown = now, true
		fmt.Fprintf(w, "\rmapping: %5.1f%%", 100*float64(done)/float64(total))
	}
}
