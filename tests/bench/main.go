// Command bench measures blockexport against qemu-storage-daemon's FUSE
// export on the same machine in one run, over the matrix QEMU's authors
// publish (4 KiB; "aio" = libaio iodepth 16, "sync" = pvsync2 iodepth 1;
// seq/rand x read/write; direct I/O; one job; time-based) on a null device,
// a raw image and a qcow2 image, plus 1 MiB sequential bandwidth, the wall
// time of `qemu-img convert -n` of a 1 GiB image into each export, and each
// daemon's peak RSS, and what loop-mount users do (ext4 on the export
// through a loop device: copy a tree in, read it back cold, fsck). Rows
// rotate the order of the systems so drift hits all. It reports; it never
// fails on a ratio.
//
// QEMU runs at its best: every row measures every configuration its users
// can pick for that image (host I/O engine aio=threads or aio=io_uring on
// the file nodes, with or without an iothread for the export; page cache,
// like ours), and the report quotes the fastest, named beside its figure,
// with every configuration's figure in a table of its own. aio=native,
// which QEMU allows only with cache.direct=on, runs in the slow-path rows
// (blockexport --cache none against cache.direct=on); there, and for
// cold-cache reads, fio on a raw file with O_DIRECT is the ceiling.
// -qemu-config pins one configuration for quick runs.
//
// It also runs fio's nbd engine against the NBD servers (null and raw):
// qemu-storage-daemon's NBD export in the same configurations and qemu-nbd
// --aio=io_uring.
//
// And FUSE exports of an image on an NBD server (qemu-nbd --aio=io_uring
// over a unix socket): ours, qemu-storage-daemon's nbd blockdev under its
// FUSE export, and nbdfuse.
//
// Beside its dated report, a run rewrites the tables of docs/bench/README.md
// that quote the areas it ran (docs.go).
//
//	go run ./tests/bench [-runtime 5s] [-out docs/bench] [-only null,raw,qcow2,nbd,nbdsrc,loop] [-qemu-config aio=io_uring,iothread]
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats/registry"
)

// system is one exporter in one configuration.
type system struct {
	name   string // "blockexport" or "qemu-storage-daemon"
	config string // QEMU's configuration; "" for ours
	ours   bool
	start  func(target, image, mnt string, writable bool) (*exec.Cmd, error)
	// readWhole: the export is read through once, O_DIRECT, before the
	// first row (a cache of the daemon's own that the rows mean warm).
	readWhole bool
}

// key tells systems apart (several QEMU configurations run side by side).
func (s system) key() string {
	if s.config == "" {
		return s.name
	}
	return s.name + " (" + s.config + ")"
}

type row struct {
	target, name string
	unit         string // "IOPS", "MiB/s", "s", "MiB"
	qemu, ours   float64
	// file is the ceiling of the slow-path rows: fio on the image file
	// itself with O_DIRECT (0 elsewhere).
	file float64
	// disk is the disk's own speed in the same minutes (the kernel-cache
	// read rows: fio's O_DIRECT 1 MiB sequential reads of the ceiling
	// file at depth 8, caches dropped, its median; 0 elsewhere): what
	// both daemons read through.
	disk float64
	// qemuConfig names the QEMU configuration behind qemu: the best of
	// qemuAll, every configuration's figure.
	qemuConfig   string
	qemuAll      []measured
	higherBetter bool
	// area is the docs/bench/README.md block the row fills (docs.go).
	area string
}

type measured struct {
	config string
	value  float64
}

// qemuConfig is one way to run qemu-storage-daemon's export.
type qemuConfig struct {
	aio      string // the file nodes' aio=; "" for the null device
	iothread bool   // the export runs in an iothread of its own
	direct   bool   // cache.direct=on: O_DIRECT on the host file
}

func (c qemuConfig) String() string {
	var parts []string
	if c.aio != "" {
		parts = append(parts, "aio="+c.aio)
	}
	if c.direct {
		parts = append(parts, "cache.direct=on")
	}
	if c.iothread {
		parts = append(parts, "iothread")
	} else {
		parts = append(parts, "no iothread")
	}
	return strings.Join(parts, ", ")
}

// qemuConfigs lists the configurations QEMU's users can pick for target
// (-qemu-config narrows them).
func qemuConfigs(target string) []qemuConfig {
	aios := []string{"threads", "io_uring"}
	if target == "null" {
		aios = []string{""} // null-co does no host I/O
	}
	var list []qemuConfig
	for _, aio := range aios {
		for _, iot := range []bool{false, true} {
			c := qemuConfig{aio: aio, iothread: iot}
			if pinned(c) {
				list = append(list, c)
			}
		}
	}
	return list
}

// pinned says whether -qemu-config (comma-separated: aio=X, iothread,
// no-iothread) allows c.
func pinned(c qemuConfig) bool {
	for _, tok := range strings.Split(*qemuConfigFlag, ",") {
		switch tok = strings.TrimSpace(tok); {
		case tok == "":
		case tok == "iothread" && !c.iothread, tok == "no-iothread" && c.iothread:
			return false
		case strings.HasPrefix(tok, "aio="):
			if c.aio != "" && c.aio != strings.TrimPrefix(tok, "aio=") {
				return false
			}
		case tok != "iothread" && tok != "no-iothread":
			log.Fatalf("-qemu-config: unknown %q (want aio=threads|io_uring|native, iothread, no-iothread)", tok)
		}
	}
	return true
}

// qsdDirectSystems is qemu-storage-daemon's FUSE export with
// cache.direct=on (O_DIRECT on the image file) in every configuration that
// allows: aio=native needs it, io_uring and threads take it.
func qsdDirectSystems() []system {
	var list []system
	for _, aio := range []string{"native", "io_uring", "threads"} {
		for _, iot := range []bool{false, true} {
			c := qemuConfig{aio: aio, iothread: iot, direct: true}
			if !pinned(c) {
				continue
			}
			list = append(list, system{name: "qemu-storage-daemon", config: c.String(), start: func(target, image, mnt string, writable bool) (*exec.Cmd, error) {
				return startQSD(c, target, image, mnt, writable)
			}})
		}
	}
	return list
}

// qsdSystems is qemu-storage-daemon's FUSE export in every configuration
// for target.
func qsdSystems(target string) []system {
	var list []system
	for _, c := range qemuConfigs(target) {
		list = append(list, system{name: "qemu-storage-daemon", config: c.String(), start: func(target, image, mnt string, writable bool) (*exec.Cmd, error) {
			return startQSD(c, target, image, mnt, writable)
		}})
	}
	return list
}

var (
	runtimeFlag    = flag.Duration("runtime", 5*time.Second, "fio runtime per row and system")
	outDir         = flag.String("out", "docs/bench", "where the report goes")
	only           = flag.String("only", defaultOnly, "targets to run: null, raw, qcow2, slow (--cache none and cold caches), loop (ext4 through a loop device), nbd, nbdsrc (a FUSE export of an image on qemu-nbd), kcache (buffered I/O with --kernel-cache on, cold, against the file itself; and the O_DIRECT matrix with it against without it, which kcdirect runs alone), s3 (a FUSE export of a 1 GiB object in versitygw, cold and warm), http (a FUSE export of a 1 GiB image on nginx, cold and warm, against nbdkit's curl plugin behind nbdfuse and qemu-storage-daemon's curl node), convert (blockexport convert and compare against qemu-img's on 4 GiB images, to every format written, the disk-bound ones beside fio's own write), verbs (measure and info per call on a 64 GiB sparse qcow2, commit and rebase of a 4 GiB chain, against qemu-img's and beside fio writing the same bytes; -verbs-* size them), formatwrite (4 KiB random writes through fuse -w of vmdk, vhdx, vpc and vdi images, full and fresh, against qemu-storage-daemon's writable export), formats (4 KiB reads of vmdk, streamOptimized vmdk, vhdx, vpc and vdi images, read-only; or one of vmdk, vmdk-stream, vhdx, vpc, vdi), daemon (200 small qcow2 exports added, read and deleted over QMP in one daemon, three rounds, against qemu-storage-daemon: RSS, ms per add and delete, what is left; and fio through a daemon export against the one-shot fuse command); the default runs them all")
	binFlag        = flag.String("bin", "bin/blockexport", "blockexport binary")
	workDir        = flag.String("dir", "", "scratch directory for images (default: a temp dir)")
	loopReps       = flag.Int("loop-reps", 3, "loop rows: runs per system (the median of each step counts)")
	reps           = flag.Int("reps", 3, "fio matrix rows (null, raw, qcow2, formats, nbd ...): runs of ours and of the fastest other configuration per row, the medians counting (every other configuration runs once)")
	qemuConfigFlag = flag.String("qemu-config", "", "pin QEMU's configuration for a quick run (e.g. aio=io_uring,iothread); default: measure them all and quote the best")
)

func main() {
	flag.Parse()
	log.SetFlags(log.Ltime)
	dir := *workDir
	if dir == "" {
		d, err := os.MkdirTemp("", "blockexport-bench-")
		if err != nil {
			log.Fatal(err)
		}
		defer os.RemoveAll(d)
		dir = d
	}
	bin, err := filepath.Abs(*binFlag)
	if err != nil {
		log.Fatal(err)
	}
	ours := func(extra ...string) system {
		return system{name: "blockexport", ours: true, start: func(target, image, mnt string, writable bool) (*exec.Cmd, error) {
			args := append([]string{"fuse", "--log-level", "warn"}, extra...)
			if writable {
				args = append(args, "-w")
			}
			switch target {
			case "null":
				args = append(args, "null:1G")
			case "raw":
				args = append(args, "-f", "raw", image)
			case "qcow2":
				args = append(args, "-f", "qcow2", image)
			default:
				if f, ok := foreignFormats[target]; ok {
					args = append(args, "-f", f.format, image)
				}
			}
			return startAndWait(exec.Command(bin, append(args, mnt)...), mnt)
		}}
	}
	with := func(target string, o system) []system { return append([]system{o}, qsdSystems(target)...) }
	targets := map[string]bool{}
	for _, t := range strings.Split(*only, ",") {
		targets[t] = true
	}
	var rows []row
	// covered: the README blocks (docs.go) this run measures whole, which
	// it rewrites; a part of an area (-only vmdk, kcdirect, -convert-rows)
	// leaves its block as it is, as latest.md keeps a full run.
	covered := map[string]bool{}
	for _, target := range []string{"null", "raw", "qcow2"} {
		if targets[target] {
			covered[target] = true
			rows = append(rows, tag(target, benchTarget(target, dir, with(target, ours()), "", nil))...)
		}
	}
	if targets["null"] {
		// The opt-in busy-poll mode, on the rows it is for.
		rows = append(rows, tag("null", benchTarget("null", dir, with("null", ours("--poll-us", "50")), " (--poll-us 50)", func(j fioJob) bool { return j.engine == "pvsync2" }))...)
	}
	if targets["qcow2"] {
		rows = append(rows, tag("qcow2", benchAlloc(dir, with("qcow2", ours())))...)
	}
	if targets["raw"] {
		rows = append(rows, tag("raw", benchConvert(dir, with("raw", ours())))...)
	}
	if targets["slow"] || *only == defaultOnly {
		covered["slow"] = true
		for _, target := range []string{"raw", "qcow2"} {
			rows = append(rows, tag("slow", benchSlow(target, dir, ours))...)
		}
	}
	if targets["loop"] || *only == defaultOnly {
		covered["loop"] = true
		for _, target := range []string{"raw", "qcow2"} {
			cached := ours("--kernel-cache", "on")
			cached.config = "--kernel-cache on"
			// The read-ahead window measured both ways: the disk's (the
			// default) and the least, one 1 MiB READ.
			shortRA := ours("--kernel-cache", "on", "--read-ahead", "1M")
			shortRA.config = "--kernel-cache on --read-ahead 1M"
			// One cache by O_DIRECT instead of drop-behind: faster on
			// every fio row of the kernel-cache target; here, where a
			// file system's small reads lose the host's read-ahead.
			direct := ours("--kernel-cache", "on", "--cache", "none")
			direct.config = "--kernel-cache on --cache none"
			// QEMU in every configuration its users can pick, O_DIRECT on
			// the image (cache.direct=on) among them, as the kernel-cache
			// rows run it.
			systems := append([]system{ours(), cached, shortRA, direct, {name: "file"}}, append(qsdSystems(target), qsdDirectSystems()...)...)
			rows = append(rows, tag("loop", benchLoop(target, dir, systems))...)
		}
	}
	if targets["nbd"] || *only == defaultOnly {
		covered["nbd"] = true
		for _, target := range []string{"null", "raw"} {
			rows = append(rows, tag("nbd", benchNBD(target, dir, bin))...)
		}
	}
	if targets["nbdsrc"] || *only == defaultOnly {
		covered["nbdsrc"] = true
		rows = append(rows, tag("nbdsrc", benchNBDSource(dir, bin))...)
	}
	if targets["s3"] {
		covered["s3"] = true
		rows = append(rows, tag("s3", benchS3(dir, bin))...)
	}
	if targets["http"] {
		covered["http"] = true
		rows = append(rows, tag("http", benchHTTP(dir, bin))...)
	}
	if targets["kcache"] || *only == defaultOnly {
		covered["kcache"] = true
		rows = append(rows, tag("kcache", benchKernelCache(dir, ours))...)
	}
	if targets["kcache"] || targets["kcdirect"] || *only == defaultOnly {
		// O_DIRECT opens keep direct_io under --kernel-cache on: the
		// page-cache rows' O_DIRECT matrix with it, against the same
		// export without it in the same minutes (the compared-with
		// column is then ours, kernel cache off: the issue asks for no
		// worse than that).
		off := ours()
		off.ours, off.config = false, "--kernel-cache off"
		rows = append(rows, tag("kcache", benchTarget("raw", dir, []system{ours("--kernel-cache", "on"), off}, " (--kernel-cache on vs off)", nil))...)
	}
	if targets["convert"] {
		covered["convert"] = *cvRows == ""
		rows = append(rows, tag("convert", cvBenchConvert(dir, bin))...)
	}
	if targets["formatwrite"] {
		covered["formatwrite"] = true
		rows = append(rows, tag("formatwrite", benchFormatWrite(dir, bin))...)
	}
	if targets["verbs"] {
		covered["verbs"] = true
		rows = append(rows, tag("verbs", benchVerbs(dir, bin))...)
	}
	covered["formats"] = true
	for _, target := range foreignTargets() {
		if targets["formats"] || targets[target] || *only == defaultOnly {
			rows = append(rows, tag("formats", benchTarget(target, dir, with(target, ours()), "", func(j fioJob) bool { return j.bs == "4k" }))...)
		} else {
			covered["formats"] = false
		}
	}
	if targets["formats"] || targets["vmdk-stream"] || *only == defaultOnly {
		// Random reads of a streamOptimized image inflate a grain each
		// unless the grain is held inflated: with a cache the size of the
		// image, read through once first, what the issue's "within 2× of
		// monolithicSparse" asks of grains cached.
		cached := ours("--decompressed-cache-size", "1280M")
		cached.readWhole = true
		rows = append(rows, tag("formats", benchTarget("vmdk-stream", dir, with("vmdk-stream", cached), " (--decompressed-cache-size 1280M, read once first)",
			func(j fioJob) bool { return j.bs == "4k" && strings.HasPrefix(j.rw, "rand") }))...)
	}
	if targets["daemon"] || *only == defaultOnly {
		covered["daemon"] = true
		rows = append(rows, tag("daemon", benchDaemon(dir, bin, ours))...)
	}
	if err := report(rows, covered); err != nil {
		log.Fatal(err)
	}
}

const defaultOnly = "null,raw,qcow2,slow,loop,nbd,nbdsrc,kcache,formats,http,s3,convert,verbs,formatwrite,daemon"

// foreignFormats are the read rows' targets of the formats besides raw
// and qcow2: the same 1 GiB of random data converted by qemu-img (format
// and its -o options), read through each export (read-only).
var foreignFormats = map[string]struct{ format, opts string }{
	"vmdk":        {"vmdk", "subformat=monolithicSparse"},
	"vmdk-stream": {"vmdk", "subformat=streamOptimized"},
	"vhdx":        {"vhdx", ""},
	"vpc":         {"vpc", "subformat=dynamic"},
	"vdi":         {"vdi", "static=off"},
}

// foreignTargets are foreignFormats' targets in the registry's order of
// the formats read here besides raw and qcow2 (which the matrix has), a
// format's variants after it; such a format without a target stops the
// bench, so that a new one is benched. Written formats keep their read
// rows (their writes are formatwrite.go's): asking ReadOnlyFormats
// dropped vmdk, vpc and vdi from these rows once they became writable.
func foreignTargets() []string {
	var ts []string
	for _, f := range registry.FileFormats() {
		if f == registry.Raw || f == registry.QCOW2 {
			continue
		}
		n := len(ts)
		for t, ff := range foreignFormats {
			if ff.format == f {
				ts = append(ts, t)
			}
		}
		if len(ts) == n {
			log.Fatalf("bench: no target for the read-only format %s (add one to foreignFormats)", f)
		}
		slices.Sort(ts[n:])
	}
	return ts
}

// qsdArgs are qemu-storage-daemon's --object and --blockdev arguments for
// target in configuration c, the node an export takes, and what an export
// adds to run in the iothread.
func qsdArgs(c qemuConfig, target, image string) (args []string, node, exportOpts string) {
	if c.iothread {
		args = append(args, "--object", "iothread,id=iot0")
		exportOpts = ",iothread=iot0"
	}
	file := "file,node-name=%s,filename=" + image
	if c.aio != "" {
		file += ",aio=" + c.aio
	}
	if c.direct {
		file += ",cache.direct=on"
	}
	switch target {
	case "null":
		args = append(args, "--blockdev", "null-co,node-name=n,size=1073741824,read-zeroes=on")
		node = "n"
	case "raw":
		args = append(args, "--blockdev", fmt.Sprintf(file, "n"))
		node = "n"
	case "qcow2":
		args = append(args, "--blockdev", fmt.Sprintf(file, "f"), "--blockdev", "qcow2,node-name=q,file=f")
		node = "q"
	default:
		if f, ok := foreignFormats[target]; ok {
			// Read-only nodes: the image is shared with our export,
			// and a read-write node takes the write lock.
			args = append(args, "--blockdev", fmt.Sprintf(file, "f")+",read-only=on", "--blockdev", f.format+",node-name=q,file=f,read-only=on")
			node = "q"
		} else if fw := fwQsdArgs(target, fmt.Sprintf(file, "f")); fw != nil {
			args, node = append(args, fw...), "q" // formatwrite.go: written in place
		}
	}
	return args, node, exportOpts
}

func startQSD(c qemuConfig, target, image, mnt string, writable bool) (*exec.Cmd, error) {
	args, node, opts := qsdArgs(c, target, image)
	w := "off"
	if writable {
		w = "on"
	}
	args = append(args, "--export", fmt.Sprintf("fuse,id=e,node-name=%s,mountpoint=%s,writable=%s%s", node, mnt, w, opts))
	return startAndWait(exec.Command("qemu-storage-daemon", args...), mnt)
}

// startAndWait starts a daemon and waits until mnt is a FUSE mount.
func startAndWait(cmd *exec.Cmd, mnt string) (*exec.Cmd, error) {
	os.WriteFile(mnt, nil, 0o600)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	for i := 0; i < 500; i++ {
		if mounted(mnt) {
			return cmd, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	cmd.Process.Kill()
	cmd.Wait()
	return nil, fmt.Errorf("%s did not mount %s", cmd.Path, mnt)
}

func mounted(path string) bool {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 4 && f[4] == path && strings.Contains(l, " - fuse") {
			return true
		}
	}
	return false
}

func stop(cmd *exec.Cmd, mnt string) {
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		<-done
	}
	if mounted(mnt) {
		syscall.Unmount(mnt, syscall.MNT_DETACH)
	}
}

// peakRSS is the daemon's high-water resident set in MiB.
func peakRSS(pid int) float64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmHWM:") {
			kb, _ := strconv.ParseFloat(strings.Fields(l)[1], 64)
			return kb / 1024
		}
	}
	return 0
}

// makeImage creates the raw or qcow2 image a target runs on: 1 GiB, fully
// allocated with non-zero data (qcow2 with 64 KiB clusters).
func makeImage(target, path string) error {
	rawPath := path
	foreign, isForeign := foreignFormats[target]
	if target == "qcow2" || isForeign {
		rawPath = path + ".src"
	}
	if err := run("fio", "--name=fill", "--filename="+rawPath, "--rw=write", "--bs=1M", "--size=1G",
		"--ioengine=psync", "--refill_buffers", "--output=/dev/null"); err != nil {
		return err
	}
	defer uncache(path)
	if target == "qcow2" {
		defer os.Remove(rawPath)
		return run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=65536", rawPath, path)
	}
	if isForeign {
		defer os.Remove(rawPath)
		args := []string{"convert", "-f", "raw", "-O", foreign.format}
		if foreign.opts != "" {
			args = append(args, "-o", foreign.opts)
		}
		return run("qemu-img", append(args, rawPath, path)...)
	}
	return nil
}

// uncache writes a new image's pages out and drops them, so that warm
// fills the page cache as reading an image from disk does (what a user's
// image is cached by). The pages a writer leaves keep the sizes of its
// writes: qemu-img writes a monolithicSparse vmdk a 64 KiB grain at a
// time, and those stay small folios where read-ahead fills large ones,
// so every 4 KiB read walks further down the page cache's tree.
// Measured here on a vmdk made so, 4 KiB random reads at queue depth 16
// before and after its pages were dropped and read back:
// qemu-storage-daemon (aio=io_uring) 44k → 46.5k, blockexport 62k → 72k;
// the vhdx and raw images read as fast either way.
func uncache(path string) {
	f, err := os.Open(path)
	if err == nil {
		defer f.Close()
		if err = unix.Fdatasync(int(f.Fd())); err == nil {
			err = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
		}
	}
	if err != nil {
		log.Printf("%s: dropping its pages: %v (the rows read it as its maker left it)", path, err)
	}
}

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %v: %v\n%s", name, args, err, out)
	}
	return nil
}

// warm reads the image so both systems start with it in the page cache.
func warm(path string) {
	if path != "" {
		run("dd", "if="+path, "of=/dev/null", "bs=1M")
	}
}

type fioJob struct {
	name, rw, engine string
	bs               string
	depth            int
}

func matrix() []fioJob {
	var jobs []fioJob
	for _, dir := range []string{"read", "write"} {
		for _, pattern := range []string{"seq", "rand"} {
			rw := dir
			if pattern == "rand" {
				rw = "rand" + dir
			}
			short := map[string]string{"read": "R", "write": "W"}[dir]
			jobs = append(jobs,
				fioJob{short + " " + pattern + " aio", rw, "libaio", "4k", 16},
				fioJob{short + " " + pattern + " sync", rw, "pvsync2", "4k", 1})
		}
	}
	jobs = append(jobs,
		fioJob{"R 1 MiB seq (MiB/s)", "read", "libaio", "1M", 16},
		fioJob{"W 1 MiB seq (MiB/s)", "write", "libaio", "1M", 16})
	return jobs
}

// fio runs one job and returns IOPS (4 KiB rows) or MiB/s (1 MiB rows).
func fio(job fioJob, file string) (float64, error) {
	return fioRun(job, file, "--time_based", "--runtime="+strconv.Itoa(int(runtimeFlag.Seconds())),
		"--ramp_time=1", "--size=1G")
}

// fioCount runs job for a fixed number of I/Os over size bytes.
func fioCount(job fioJob, file, size string, ios int) (float64, error) {
	return fioRun(job, file, "--size="+size, "--number_ios="+strconv.Itoa(ios))
}

func fioRun(job fioJob, file string, extra ...string) (float64, error) {
	args := []string{"--name=b", "--filename=" + file, "--rw=" + job.rw, "--bs=" + job.bs,
		"--ioengine=" + job.engine, "--iodepth=" + strconv.Itoa(job.depth), "--direct=1",
		"--numjobs=1", "--output-format=json"}
	out, err := exec.Command("fio", append(args, extra...)...).Output()
	if err != nil {
		return 0, fmt.Errorf("fio %s on %s: %v", job.name, file, err)
	}
	var res struct {
		Jobs []struct {
			Read, Write struct {
				IOPS  float64 `json:"iops"`
				BWKiB float64 `json:"bw"`
			}
		} `json:"jobs"`
	}
	if err := json.Unmarshal(out, &res); err != nil || len(res.Jobs) == 0 {
		return 0, fmt.Errorf("fio output: %v", err)
	}
	st := res.Jobs[0].Read
	if strings.Contains(job.rw, "write") {
		st = res.Jobs[0].Write
	}
	if job.bs == "1M" {
		return st.BWKiB / 1024, nil
	}
	return st.IOPS, nil
}

// benchTarget runs the matrix (the jobs keep selects, all when nil) on one
// target; suffix marks the rows' names.
func benchTarget(target, dir string, systems []system, suffix string, keep func(fioJob) bool) []row {
	log.Printf("target %s", target)
	// One image each: QEMU locks the images it opens for writing. The
	// read-only formats share one (read locks share).
	_, readOnly := foreignFormats[target]
	images := map[string]string{}
	for i, s := range systems {
		if target == "null" {
			continue
		}
		if readOnly && i > 0 {
			images[s.key()] = images[systems[0].key()]
			continue
		}
		p := filepath.Join(dir, fmt.Sprintf("%s-%d.img", target, i))
		if err := makeImage(target, p); err != nil {
			log.Fatal(err)
		}
		images[s.key()] = p
	}
	defer func() {
		for _, p := range images {
			os.Remove(p)
		}
	}()
	// Both sides write (qcow2: into the allocated clusters of a full
	// image; allocating writes have rows of their own, benchAlloc).
	writable := !readOnly
	type live struct {
		cmd *exec.Cmd
		mnt string
	}
	daemons := map[string]live{}
	for i, s := range systems {
		mnt := filepath.Join(dir, fmt.Sprintf("%s-%d.mnt", target, i))
		cmd, err := s.start(target, images[s.key()], mnt, writable)
		if err != nil {
			// log.Fatal runs no deferred stop: unmount what is up first
			// (a failed start left our export mounted once).
			for _, d := range daemons {
				stop(d.cmd, d.mnt)
			}
			log.Fatal(err)
		}
		daemons[s.key()] = live{cmd, mnt}
		if s.readWhole {
			if err := run("dd", "if="+mnt, "of=/dev/null", "bs=1M", "iflag=direct"); err != nil {
				log.Printf("%s: read the export whole: %v", s.key(), err)
			}
		}
	}
	defer func() {
		for _, d := range daemons {
			stop(d.cmd, d.mnt)
		}
	}()
	var rows []row
	for i, job := range matrix() {
		if !writable && strings.Contains(job.rw, "write") || keep != nil && !keep(job) {
			continue
		}
		r := row{target: target, name: job.name + suffix, unit: "IOPS", higherBetter: true}
		if job.bs == "1M" {
			r.unit = "MiB/s"
		}
		runs := map[string][]float64{}
		once := func(s system) float64 {
			warm(images[s.key()])
			v, err := fio(job, daemons[s.key()].mnt)
			if err != nil {
				log.Printf("%s: %v", s.key(), err)
			}
			runs[s.key()] = append(runs[s.key()], v)
			return v
		}
		for _, s := range rotate(systems, i) {
			r.add(s, once(s))
		}
		// Every configuration once, then ours and the fastest of the
		// others -reps-1 times more, the order rotating, and the medians
		// count (as the kcache and http rows): the best of four or ten
		// single runs quotes a competitor's luckiest seconds against one
		// of ours.
		if best := r.qemuConfig; *reps > 1 && best != "" {
			for rep := 1; rep < *reps; rep++ {
				for _, s := range rotate(systems, i+rep) {
					if s.ours || s.key() == best {
						once(s)
					}
				}
			}
			for _, s := range systems {
				if s.ours || s.key() == best {
					log.Printf("  %-34s %s: %v", r.name, s.key(), runs[s.key()])
				}
				if s.ours {
					r.ours = median(runs[s.key()])
				}
			}
			r.qemu = median(runs[best])
		}
		logRow(r)
		rows = append(rows, r)
	}
	if keep != nil {
		return rows
	}
	rss := row{target: target, name: "peak RSS (MiB)", unit: "MiB"}
	for _, s := range systems {
		rss.add(s, peakRSS(daemons[s.key()].cmd.Process.Pid))
	}
	return append(rows, rss)
}

// rotate is systems starting at the i-th: each row puts another one first,
// so drift over the run hits every system alike.
func rotate(systems []system, i int) []system {
	k := i % len(systems)
	return append(append([]system{}, systems[k:]...), systems[:k]...)
}

// allocIOs is how many 4 KiB writes an allocating row makes: spread over
// a 64 GiB image of 64 KiB clusters, nearly every random one allocates.
const allocIOs = 16384

// benchAlloc measures allocating writes: for each 4 KiB write row, each
// system gets a new, empty 64 GiB qcow2 image and makes allocIOs writes.
func benchAlloc(dir string, systems []system) []row {
	log.Printf("target qcow2 (allocating writes)")
	var rows []row
	for i, job := range matrix() {
		if !strings.Contains(job.rw, "write") || job.bs != "4k" {
			continue
		}
		r := row{target: "qcow2 new", name: job.name + " (allocating)", unit: "IOPS", higherBetter: true}
		for _, s := range rotate(systems, i) {
			img := filepath.Join(dir, "alloc.qcow2")
			mnt := filepath.Join(dir, "alloc.mnt")
			if err := run("qemu-img", "create", "-q", "-f", "qcow2", img, "64G"); err != nil {
				log.Fatal(err)
			}
			cmd, err := s.start("qcow2", img, mnt, true)
			if err != nil {
				log.Fatal(err)
			}
			v, err := fioCount(job, mnt, "64G", allocIOs)
			if err != nil {
				log.Printf("%s: %v", s.key(), err)
			}
			stop(cmd, mnt)
			os.Remove(img)
			r.add(s, v)
		}
		logRow(r)
		rows = append(rows, r)
	}
	return rows
}

// benchConvert times qemu-img convert -n of a 1 GiB image into each export
// of a raw image.
func benchConvert(dir string, systems []system) []row {
	src := filepath.Join(dir, "convert-src.img")
	if err := makeImage("raw", src); err != nil {
		log.Fatal(err)
	}
	defer os.Remove(src)
	r := row{target: "raw", name: "qemu-img convert -n 1 GiB (s)", unit: "s"}
	// Each system converts twice and keeps the faster: the first convert
	// after other work ran 2-3x slower here whichever system got it (3.4-3.6
	// s against 1.2-1.6), so one attempt measured the order, not the export.
	for _, s := range systems {
		best := 0.0
		for range 2 {
			took, err := convertInto(s, src, filepath.Join(dir, "convert-dst.img"))
			if err != nil {
				log.Printf("%s: %v", s.key(), err)
				continue
			}
			if best == 0 || took < best {
				best = took
			}
		}
		r.add(s, best)
	}
	logRow(r)
	return []row{r}
}

// convertInto times qemu-img convert -n of src into an export of a new,
// empty raw image at dst.
func convertInto(s system, src, dst string) (float64, error) {
	f, err := os.Create(dst)
	if err != nil {
		return 0, err
	}
	f.Truncate(1 << 30)
	f.Close()
	defer os.Remove(dst)
	mnt := dst + ".mnt"
	cmd, err := s.start("raw", dst, mnt, true)
	if err != nil {
		return 0, err
	}
	defer stop(cmd, mnt)
	run("sync") // nobody inherits the write-back of what ran before
	warm(src)
	t0 := time.Now()
	err = run("qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, mnt)
	return time.Since(t0).Seconds(), err
}

// add records one system's measurement; for QEMU the row keeps every
// configuration's and quotes the best (0 is a failed run, never best).
func (r *row) add(s system, v float64) {
	if s.ours {
		r.ours = v
		return
	}
	// Named with the system (qemu-storage-daemon, nbdfuse, ours with
	// the kernel cache off in the kcache rows): the rows do not all
	// compare with the same program.
	r.qemuAll = append(r.qemuAll, measured{s.key(), v})
	if v != 0 && (r.qemu == 0 || r.higherBetter == (v > r.qemu)) {
		r.qemu, r.qemuConfig = v, s.key()
	}
}

// logRow prints a finished row.
func logRow(r row) {
	log.Printf("  %-34s qemu %10.2f (%s)  ours %10.2f  x%.2f", r.name, r.qemu, r.qemuConfig, r.ours, ratio(r))
}

// ratio is ours over QEMU's, turned so that above 1 is better for us.
func ratio(r row) float64 {
	if r.qemu == 0 || r.ours == 0 {
		return 0
	}
	if r.higherBetter {
		return r.ours / r.qemu
	}
	return r.qemu / r.ours
}

// report writes the dated report and chart, latest.md for a full run, and
// the README's tables of the areas the run covered (docs.go).
func report(rows []row, covered map[string]bool) error {
	if err := os.MkdirAll(*outDir, 0o755); err != nil {
		return err
	}
	stamp := time.Now().UTC().Format("2006-01-02T1504Z")
	var b strings.Builder
	fmt.Fprintf(&b, "# blockexport vs qemu-storage-daemon — %s\n\n", stamp)
	mach := machine()
	fmt.Fprintf(&b, "%s\n\n", mach)
	fmt.Fprintf(&b, "fio: 4 KiB, direct=1, numjobs=1, time_based, runtime %v (+1 s ramp) per row and system; aio = libaio iodepth 16, sync = pvsync2 iodepth 1. 1 GiB images, page cache warmed before each row (read through once; the pages left by making an image are dropped first, so both daemons read the page cache as reading the image from disk fills it); the order of the systems rotates from row to row. Ratio > 1 means blockexport is better (for time and RSS rows: smaller).\n\n", *runtimeFlag)
	fmt.Fprintf(&b, "QEMU at its best: every row ran qemu-storage-daemon in each configuration its users can pick for that image, in the same run (file nodes with aio=threads or aio=io_uring, with or without an iothread for the export; page cache, as blockexport runs by default; aio=native needs cache.direct=on and so applies only where QEMU runs with cache.direct=on: the --cache none rows, the kernel-cache rows and the loop rows, with aio=native, io_uring or threads, with or without an iothread), and the compared-with column quotes the fastest, named beside it. The NBD rows add qemu-nbd --aio=io_uring and leave out the iothread (QEMU 7.2's NBD server aborts when a client of such an export disconnects). The nbd source rows compare with qemu-storage-daemon (an nbd blockdev under its FUSE export) and nbdfuse. The fio rows (the matrix, kcache and http) run each configuration once, then ours and the fastest of them twice more (-reps, -kcache-reps, -http-reps), and quote the medians; the loop rows run every system %d times (-loop-reps), medians; the convert rows take every tool's best of two. Every configuration's figure (its first run) is in the last table.%s\n\n", *loopReps, pinNote())
	fmt.Fprintf(&b, "![ratios](%s.svg)\n\n", stamp)
	b.WriteString(ratioTable(rows))
	fmt.Fprintf(&b, "\n## The slow path against the device\n\nThe slow-path rows beside fio on a raw file of the same size with O_DIRECT (the device itself, no FUSE): what a request through either export adds to the disk's own latency; the kernel-cache rows beside the same buffered job on the file itself, the loop rows beside a loop device on the image file itself, and the commit and rebase rows (verbs) beside fio writing the bytes they write, sequentially through the page cache with an fsync at the end (the disk's speed). The last column is blockexport's speed over the file's (above 1: faster; for time rows the file's time over ours).\n\n| target | row | device (fio on the file) | compared with, best | blockexport | blockexport vs device |\n|---|---|---:|---:|---:|---:|\n")
	for _, r := range rows {
		if r.file == 0 {
			continue
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %.2f× |\n", r.target, r.name, num(r.file, r.unit), num(r.qemu, r.unit), num(r.ours, r.unit), speedVsFile(r))
	}
	if slices.ContainsFunc(rows, func(r row) bool { return r.disk != 0 }) {
		fmt.Fprintf(&b, "\n## The kernel-cache read rows against the disk\n\nBoth exports read the image from the same disk: beside each buffered read row, fio's O_DIRECT 1 MiB sequential reads of the ceiling file at depth 8 (caches dropped, in every round of the row, the median), and each daemon's speed over it.\n\n| target | row | the disk | QEMU, best | blockexport | QEMU / disk | blockexport / disk |\n|---|---|---:|---:|---:|---:|---:|\n")
		for _, r := range rows {
			if r.disk == 0 {
				continue
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %.2f | %.2f |\n", r.target, r.name, num(r.disk, r.unit), num(r.qemu, r.unit), num(r.ours, r.unit), r.qemu/r.disk, r.ours/r.disk)
		}
	}
	fmt.Fprintf(&b, "\n## Every configuration compared with\n\n| target | row | figures |\n|---|---|---|\n")
	for _, r := range rows {
		if len(r.qemuAll) == 0 {
			continue
		}
		var cells []string
		all := slices.SortedFunc(slices.Values(r.qemuAll), func(a, b measured) int { return strings.Compare(a.config, b.config) })
		for _, m := range all {
			cells = append(cells, fmt.Sprintf("%s: %s", m.config, num(m.value, r.unit)))
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", r.target, r.name, strings.Join(cells, "; "))
	}
	md := filepath.Join(*outDir, stamp+".md")
	if err := os.WriteFile(md, []byte(b.String()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(*outDir, stamp+".svg"), []byte(chart(rows)), 0o644); err != nil {
		return err
	}
	// latest.md is the newest run of every area: a run narrowed with
	// -only (or -qemu-config) is a dated report only, so latest.md never
	// shows one area in place of all of them.
	if *only == defaultOnly && *qemuConfigFlag == "" {
		if err := os.WriteFile(filepath.Join(*outDir, "latest.md"), []byte(b.String()), 0o644); err != nil {
			return err
		}
	}
	fmt.Print(b.String())
	log.Printf("report: %s", md)
	// The README quotes QEMU at its best: a pinned run is a quick look,
	// its report dated only, like latest.md's rule above.
	if *qemuConfigFlag != "" {
		return nil
	}
	readme := filepath.Join(*outDir, "README.md")
	if _, err := os.Stat(readme); os.IsNotExist(err) {
		return nil // -out elsewhere: a directory of reports only
	}
	areas, err := updateReadme(readme, stamp, mach, rows, covered)
	if err != nil {
		return err
	}
	if len(areas) > 0 {
		log.Printf("%s: rewrote the tables of %s", readme, strings.Join(areas, ", "))
	}
	return nil
}

// ratioTable is the report's main table of rows, which the README's blocks
// quote too. A row with nothing to compare with (QEMU has no S3 driver)
// shows a dash there and in the ratio, not a zero that reads as a failure.
func ratioTable(rows []row) string {
	var b strings.Builder
	b.WriteString("| target | row | compared with: the best of its configurations | blockexport | ratio |\n|---|---|---:|---:|---:|\n")
	for _, r := range rows {
		q, x := num(r.qemu, r.unit), fmt.Sprintf("%.2f×", ratio(r))
		if r.qemuConfig != "" {
			q += ", " + r.qemuConfig
		}
		if r.qemu == 0 && len(r.qemuAll) == 0 {
			q, x = "—", "—"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", r.target, r.name, q, num(r.ours, r.unit), x)
	}
	return b.String()
}

// pinNote says when -qemu-config narrowed the configurations.
func pinNote() string {
	if *qemuConfigFlag == "" {
		return ""
	}
	return fmt.Sprintf(" **This run pinned QEMU to %q: a quick look, not QEMU at its best.**", *qemuConfigFlag)
}

func num(v float64, unit string) string {
	switch unit {
	case "IOPS":
		return fmt.Sprintf("%.1fk", v/1000)
	case "s":
		return fmt.Sprintf("%.2f s", v)
	case "ms":
		return fmt.Sprintf("%.2f ms", v)
	}
	return fmt.Sprintf("%.0f %s", v, unit)
}

func machine() string {
	kernel, _ := exec.Command("uname", "-r").Output()
	qv, _ := exec.Command("qemu-storage-daemon", "--version").Output()
	fv, _ := exec.Command("fio", "--version").Output()
	cpu := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				cpu = strings.TrimSpace(strings.SplitN(l, ":", 2)[1])
				break
			}
		}
	}
	return fmt.Sprintf("Machine: %d CPUs (%s), Linux %s; %s; %s; %s.", runtime.NumCPU(), cpu,
		strings.TrimSpace(string(kernel)), strings.SplitN(strings.TrimSpace(string(qv)), "\n", 2)[0],
		strings.TrimSpace(string(fv)), runtime.Version())
}

// chart draws the ratios as horizontal bars with a line at 1.0.
func chart(rows []row) string {
	const w, bar, left = 760, 18, 300
	h := 40 + len(rows)*(bar+6)
	maxR := 2.0
	for _, r := range rows {
		maxR = max(maxR, ratio(r))
	}
	scale := float64(w-left-60) / maxR
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`, w, h)
	fmt.Fprintf(&b, `<text x="10" y="18" font-weight="bold">blockexport / qemu-storage-daemon (higher is better)</text>`)
	for i, r := range rows {
		y := 30 + i*(bar+6)
		x := ratio(r)
		color := "#2a9d8f"
		if x < 1 {
			color = "#e76f51"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%s %s</text>`, left-8, y+13, r.target, xmlEscape(r.name))
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`, left, y, x*scale, bar, color)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d">%.2f×</text>`, float64(left)+x*scale+4, y+13, x)
	}
	fmt.Fprintf(&b, `<line x1="%.1f" y1="26" x2="%.1f" y2="%d" stroke="#333" stroke-dasharray="4 3"/>`, float64(left)+scale, float64(left)+scale, h-4)
	b.WriteString(`</svg>`)
	return b.String()
}

func xmlEscape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;").Replace(s)
}

// benchNBD runs fio's nbd engine (4 KiB, iodepth 16) against the NBD
// servers on a unix socket: qemu-storage-daemon's NBD export in each of
// its configurations, qemu-nbd --aio=io_uring, and blockexport nbd, on the
// null device or the same kind of raw file.
func benchNBD(target, dir, bin string) []row {
	log.Printf("target nbd %s", target)
	image := ""
	if target == "raw" {
		image = filepath.Join(dir, "nbd.img")
		if err := makeImage("raw", image); err != nil {
			log.Fatal(err)
		}
		defer os.Remove(image)
	}
	type server struct {
		s   system
		cmd func(sock string) *exec.Cmd
	}
	servers := []server{{system{name: "blockexport", ours: true}, func(sock string) *exec.Cmd {
		spec, f := "null:1G", "null"
		if target == "raw" {
			spec, f = image, "raw"
		}
		return exec.Command(bin, "nbd", "--log-level", "warn", "-w", "-f", f, "--listen", "unix:"+sock, spec)
	}}}
	for _, c := range qemuConfigs(target) {
		if c.iothread {
			// QEMU 7.2's NBD server aborts when a client of an export in
			// an iothread disconnects (assertion in
			// nbd_blockdev_client_closed), as measured here: not a
			// configuration anyone can run.
			continue
		}
		servers = append(servers, server{system{name: "qemu-storage-daemon", config: c.String()}, func(sock string) *exec.Cmd {
			args, node, opts := qsdArgs(c, target, image)
			args = append(args, "--nbd-server", "addr.type=unix,addr.path="+sock, "--export", "nbd,id=e,node-name="+node+",writable=on,name="+opts)
			return exec.Command("qemu-storage-daemon", args...)
		}})
	}
	if pinned(qemuConfig{aio: "io_uring"}) {
		servers = append(servers, server{system{name: "qemu-nbd", config: "qemu-nbd --aio=io_uring"}, func(sock string) *exec.Cmd {
			img := "driver=null-co,size=1073741824,read-zeroes=on"
			if target == "raw" {
				img = "driver=file,filename=" + image
			}
			return exec.Command("qemu-nbd", "--aio=io_uring", "--image-opts", img, "--socket="+sock, "--persistent", "--shared=16")
		}})
	}
	var rows []row
	for i, rw := range []string{"read", "randread", "write", "randwrite"} {
		r := row{target: "nbd " + target, name: rw + " 4k iodepth 16", unit: "IOPS", higherBetter: true}
		for j := range servers {
			sv := servers[(i+j)%len(servers)]
			// One server at a time: they share the image, which QEMU locks.
			sock := filepath.Join(dir, "nbd.sock")
			os.Remove(sock)
			cmd := sv.cmd(sock)
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				log.Fatal(err)
			}
			for k := 0; k < 500; k++ {
				if _, err := os.Stat(sock); err == nil {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			warm(image)
			v, err := fioNBD(rw, "nbd+unix:///?socket="+sock)
			if err != nil {
				log.Printf("%s: %v", sv.s.key(), err)
			}
			cmd.Process.Signal(syscall.SIGTERM)
			cmd.Wait()
			r.add(sv.s, v)
		}
		logRow(r)
		rows = append(rows, r)
	}
	return rows
}

func fioNBD(rw, uri string) (float64, error) {
	out, err := exec.Command("fio", "--name=b", "--ioengine=nbd", "--uri="+uri, "--rw="+rw, "--bs=4k",
		"--iodepth=16", "--size=1G", "--time_based", "--runtime="+strconv.Itoa(int(runtimeFlag.Seconds())),
		"--ramp_time=1", "--output-format=json").Output()
	if err != nil {
		return 0, fmt.Errorf("fio nbd %s: %v", rw, err)
	}
	// The nbd engine may print a line of its own before the JSON.
	if i := bytes.IndexByte(out, '{'); i > 0 {
		out = out[i:]
	}
	var res struct {
		Jobs []struct{ Read, Write struct{ IOPS float64 } } `json:"jobs"`
	}
	if err := json.Unmarshal(out, &res); err != nil || len(res.Jobs) == 0 {
		return 0, fmt.Errorf("fio output: %v", err)
	}
	if strings.Contains(rw, "write") {
		return res.Jobs[0].Write.IOPS, nil
	}
	return res.Jobs[0].Read.IOPS, nil
}

// benchLoop is what people who loop-mount an image do: ext4 on the export
// through a loop device, a tree of real files (the Go toolchain: about
// 270 MB in 15,000 files) copied in and synced, read back with every cache
// dropped (tar), and checked (e2fsck -f). Wall time of each step; every
// system starts from a new, empty 2 GiB image. Each of our configurations
// (systems with ours set, told apart by config) gets its own rows against
// QEMU's best; a system named "file" is the loop device on the image file
// itself, no FUSE: the ceiling, in the rows' file column.
func benchLoop(target, dir string, systems []system) []row {
	log.Printf("target %s (ext4 through a loop device)", target)
	out, err := exec.Command("go", "env", "GOROOT").Output()
	if err != nil {
		log.Fatal(err)
	}
	src := strings.TrimSpace(string(out))
	names := []string{"ext4: copy 270 MB tree + sync (s)", "ext4: read it back, cold (s)", "ext4: e2fsck -f (s)"}
	var configs []string // ours, in order
	rows := map[string][]row{}
	for _, s := range systems {
		if !s.ours {
			continue
		}
		configs = append(configs, s.config)
		suffix := ""
		if s.config != "" {
			suffix = " " + s.config
		}
		for _, n := range names {
			rows[s.config] = append(rows[s.config], row{target: target + " loop" + suffix, name: n, unit: "s"})
		}
	}
	// Each system runs the steps loopReps times, the order rotating from
	// round to round, and each step's median counts (one run of the file
	// itself read the tree back in 0.51 s, the next in 2.19 s).
	samples := map[string]*[3][]float64{}
	for rep := range *loopReps {
		for _, s := range rotate(systems, rep) {
			img := filepath.Join(dir, "loop."+target)
			mnt := img + ".mnt"
			if target == "raw" || s.name == "file" {
				err = run("truncate", "-s", "2G", img)
			} else {
				err = run("qemu-img", "create", "-q", "-f", "qcow2", img, "2G")
			}
			if err != nil {
				log.Fatal(err)
			}
			export, cmd := img, (*exec.Cmd)(nil)
			if s.name != "file" {
				if cmd, err = s.start(target, img, mnt, true); err != nil {
					log.Fatal(err)
				}
				export = mnt
			}
			times, err := loopSteps(export, src, dir)
			if cmd != nil {
				stop(cmd, mnt)
			}
			os.Remove(img)
			if err != nil {
				log.Printf("%s: %v", s.key(), err)
				times = [3]float64{} // a failed run counts for nothing
			}
			sm := samples[s.key()]
			if sm == nil {
				sm = &[3][]float64{}
				samples[s.key()] = sm
			}
			for k := range times {
				sm[k] = append(sm[k], times[k])
			}
		}
	}
	for _, s := range systems {
		sm := samples[s.key()]
		var times [3]float64
		for k := range times {
			times[k] = median(sm[k])
			if len(sm[k]) > 1 {
				log.Printf("  %-34s %s: %v -> median %.2f", names[k], s.key(), sm[k], times[k])
			}
		}
		for _, c := range configs {
			for k := range rows[c] {
				switch {
				case s.name == "file":
					rows[c][k].file = times[k]
				case s.ours && s.config == c:
					rows[c][k].ours = times[k]
				case !s.ours:
					rows[c][k].add(s, times[k])
				}
			}
		}
	}
	var all []row
	for _, c := range configs {
		for _, r := range rows[c] {
			logRow(r)
			if r.file != 0 {
				log.Printf("  %-34s file %10.2f  speed vs the loop on the file %.2f", r.name, r.file, speedVsFile(r))
			}
			all = append(all, r)
		}
	}
	return all
}

// speedVsFile is ours against the ceiling, turned so that 1 means as
// fast as the file itself (for time rows: the file's time over ours).
func speedVsFile(r row) float64 {
	if r.file == 0 || r.ours == 0 {
		return 0
	}
	if r.higherBetter {
		return r.ours / r.file
	}
	return r.file / r.ours
}

// loopSteps runs the loop-mount steps on export and times them.
func loopSteps(export, src, dir string) ([3]float64, error) {
	var t [3]float64
	out, err := exec.Command("losetup", "--find", "--show", export).Output()
	if err != nil {
		return t, fmt.Errorf("losetup: %v", err)
	}
	dev := strings.TrimSpace(string(out))
	defer run("losetup", "-d", dev)
	fs := filepath.Join(dir, "loopfs")
	os.MkdirAll(fs, 0o755)
	if err := run("mkfs.ext4", "-q", dev); err != nil {
		return t, err
	}
	if err := run("mount", dev, fs); err != nil {
		return t, err
	}
	tarTo := func(from string) error {
		cmd := exec.Command("tar", "cf", "-", "-C", from, ".")
		cmd.Stdout = io.Discard // a pipe: tar skips reading data it writes to /dev/null
		return cmd.Run()
	}
	tarTo(src) // the source tree comes from the page cache
	t0 := time.Now()
	err = run("cp", "-a", src, filepath.Join(fs, "tree"))
	if err == nil {
		err = run("sync")
	}
	t[0] = time.Since(t0).Seconds()
	if uerr := run("umount", fs); err == nil {
		err = uerr
	}
	if err != nil {
		return t, err
	}
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
		return t, err
	}
	if err := run("mount", dev, fs); err != nil {
		return t, err
	}
	t0 = time.Now()
	err = tarTo(fs)
	t[1] = time.Since(t0).Seconds()
	if uerr := run("umount", fs); err == nil {
		err = uerr
	}
	if err != nil {
		return t, err
	}
	t0 = time.Now()
	err = run("e2fsck", "-f", "-n", dev)
	t[2] = time.Since(t0).Seconds()
	return t, err
}

// benchSlow measures the path a request takes when it must wait for the
// disk, on a raw or qcow2 image: "direct" rows run blockexport --cache none
// against QEMU with cache.direct=on (aio=native, io_uring or threads, with or
// without an iothread), random 4 KiB reads and writes; "cold" rows run both
// in their default cache mode (QEMU in every configuration of the page-cache
// rows) with every cache dropped before each measurement, random reads.
// Each row also runs fio on a raw file of the same size with O_DIRECT:
// what the device itself does, the ceiling. One daemon runs at a time.
func benchSlow(target, dir string, ours func(extra ...string) system) []row {
	log.Printf("target %s (slow path: --cache none, cold caches)", target)
	img := filepath.Join(dir, "slow."+target)
	ceiling := filepath.Join(dir, "slow-ceiling.raw")
	for path, kind := range map[string]string{img: target, ceiling: "raw"} {
		if err := makeImage(kind, path); err != nil {
			log.Fatal(err)
		}
	}
	defer os.Remove(img)
	defer os.Remove(ceiling)
	run("sync")
	direct := qsdDirectSystems()
	file := system{name: "file"} // fio on the file itself
	groups := []struct {
		suffix  string
		systems []system
		jobs    []fioJob
		cold    bool
	}{
		{" (--cache none vs cache.direct=on)", append([]system{ours("--cache", "none"), file}, direct...), slowJobs(true), false},
		{" (cold cache)", append([]system{ours(), file}, qsdSystems(target)...), slowJobs(false), true},
	}
	var rows []row
	for _, g := range groups {
		for i, job := range g.jobs {
			r := row{target: target + " slow", name: job.name + g.suffix, unit: "IOPS", higherBetter: true}
			for _, s := range rotate(g.systems, i) {
				v, err := slowRun(s, job, target, img, ceiling, g.cold)
				if err != nil {
					log.Printf("%s: %v", s.key(), err)
				}
				if s.name == "file" {
					r.file = v
					continue
				}
				r.add(s, v)
			}
			log.Printf("  %-34s qemu %10.2f (%s)  ours %10.2f  x%.2f  file %10.2f  ours/file %.2f", r.name, r.qemu, r.qemuConfig, r.ours, ratio(r), r.file, r.ours/max(r.file, 1))
			rows = append(rows, r)
		}
	}
	return rows
}

// slowJobs: random 4 KiB reads (and writes, for the direct rows) at both
// queue depths.
func slowJobs(writes bool) []fioJob {
	var jobs []fioJob
	for _, rw := range []string{"randread", "randwrite"} {
		if rw == "randwrite" && !writes {
			continue
		}
		short := map[string]string{"randread": "R", "randwrite": "W"}[rw]
		jobs = append(jobs,
			fioJob{short + " rand aio", rw, "libaio", "4k", 16},
			fioJob{short + " rand sync", rw, "pvsync2", "4k", 1})
	}
	return jobs
}

// slowRun measures one system on one slow-path job: the daemon starts on
// img, caches are dropped if the row is cold, fio runs, the daemon stops.
func slowRun(s system, job fioJob, target, img, ceiling string, cold bool) (float64, error) {
	dropCaches := func() {
		run("sync")
		if cold {
			os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0)
		}
	}
	if s.name == "file" {
		dropCaches()
		return fio(job, ceiling)
	}
	mnt := img + ".mnt"
	cmd, err := s.start(target, img, mnt, true)
	if err != nil {
		return 0, err
	}
	defer stop(cmd, mnt)
	dropCaches()
	return fio(job, mnt)
}
