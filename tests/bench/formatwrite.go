package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/blockexport/blockexport/formats/registry"
)

// Writes in place (-only formatwrite): 4 KiB random writes, libaio at
// queue depth 16 and pvsync2 at queue depth 1, O_DIRECT, through the FUSE
// export (fuse -w) of an image of each format written here, against
// qemu-storage-daemon's writable FUSE export of the same image in every
// configuration (qsdSystems), the best quoted. Two kinds of rows:
//
//   - "FMT -w": a 1 GiB image whose every block holds data (1 GiB of
//     random data converted by qemu-img), so no write allocates; each
//     system writes a copy of its own (QEMU takes the write lock).
//     Targets: 1.5x at queue depth 16, 1.1x at queue depth 1.
//   - "FMT -w new": a fresh, empty dynamic image (qemu-img create) for
//     each system and row, fwAllocIOs writes spread over it: nearly every
//     one allocates a grain or block, its table entry written. Reported
//     apart from the first, as qcow2's allocating rows are.

// fwFormats are the formats and qemu-img -o options of the targets, by
// target name: the subformats QEMU 7.2 writes in place by default.
var fwFormats = map[string]struct{ format, opts string }{
	"vmdk -w": {"vmdk", "subformat=monolithicSparse"},
	"vhdx -w": {"vhdx", "subformat=dynamic"},
	"vpc -w":  {"vpc", "subformat=dynamic"},
	"vdi -w":  {"vdi", "static=off"},
}

// fwTargets are fwFormats' targets in a fixed order.
var fwTargets = []string{"vmdk -w", "vhdx -w", "vpc -w", "vdi -w"}

// fwSize is the full images' size; the allocating rows' images are 16
// times as large.
var fwSize = flag.String("formatwrite-size", "1G", "formatwrite rows: the written images' size, the allocating rows' images 16 times as large (default 1G; smaller only to check that the rows run)")

// fwAllocIOs is how many 4 KiB writes an allocating row makes into its
// 16 GiB image: nearly every one allocates a vmdk grain (64 KiB), a vdi
// block (1 MiB) or a vpc block (2 MiB, about four in five), while vhdx's
// 512 blocks of 32 MiB fill early; a format that writes a whole block
// when it allocates one (vdi) writes at most 4 GiB.
const fwAllocIOs = 4096

// fwJobs are the rows' fio jobs: the matrix's 4 KiB random writes.
func fwJobs() []fioJob {
	var jobs []fioJob
	for _, j := range matrix() {
		if j.rw == "randwrite" && j.bs == "4k" {
			jobs = append(jobs, j)
		}
	}
	return jobs
}

// benchFormatWrite runs the formatwrite rows for each format this build
// writes in place (registry.WritableFormats); a target whose format it
// does not write is left out, said in the log.
func benchFormatWrite(dir, bin string) []row {
	size, err := registry.ParseSize(*fwSize)
	if err != nil || size < 16<<20 || size%(1<<20) != 0 {
		log.Fatalf("-formatwrite-size %q: want a whole number of MiB, at least 16M", *fwSize)
	}
	var rows []row
	for _, target := range fwTargets {
		f := fwFormats[target]
		if !slices.Contains(registry.WritableFormats(), f.format) {
			log.Printf("target %s: left out, %s images are not written in place by this build (want %s)", target, f.format, registry.OrList(registry.WritableFormats()))
			continue
		}
		ours := system{name: "blockexport", ours: true, start: func(_, image, mnt string, writable bool) (*exec.Cmd, error) {
			args := []string{"fuse", "--log-level", "warn", "-f", f.format}
			if writable {
				args = append(args, "-w")
			}
			return startAndWait(exec.Command(bin, append(args, image, mnt)...), mnt)
		}}
		systems := append([]system{ours}, qsdSystems(target)...)
		rows = append(rows, fwWritten(target, dir, size, systems)...)
		rows = append(rows, fwAllocating(target, dir, 16*size, systems)...)
	}
	return rows
}

// fwMakeImage writes an image of target's format at path whose every
// block holds data: size bytes of random data, converted by qemu-img.
func fwMakeImage(target, path string, size int64) error {
	f := fwFormats[target]
	raw := path + ".src"
	defer os.Remove(raw)
	if err := run("fio", "--name=fill", "--filename="+raw, "--rw=write", "--bs=1M", "--size="+strconv.FormatInt(size, 10),
		"--ioengine=psync", "--refill_buffers", "--output=/dev/null"); err != nil {
		return err
	}
	defer uncache(path)
	return run("qemu-img", "convert", "-f", "raw", "-O", f.format, "-o", f.opts, raw, path)
}

// fwWritten is the rows of 4 KiB random writes into full images: every
// system its own copy, every configuration once, then ours and QEMU's
// fastest -reps-1 times more, the order rotating, medians quoted (as the
// matrix's rows).
func fwWritten(target, dir string, size int64, systems []system) []row {
	log.Printf("target %s (%s, every block allocated)", target, sizeName(size))
	images := map[string]string{}
	defer func() {
		for _, p := range images {
			os.Remove(p)
		}
	}()
	type live struct {
		cmd *exec.Cmd
		mnt string
	}
	daemons := map[string]live{}
	defer func() {
		for _, d := range daemons {
			stop(d.cmd, d.mnt)
		}
	}()
	for i, s := range systems {
		p := filepath.Join(dir, fmt.Sprintf("fw-%d.%s", i, fwFormats[target].format))
		if err := fwMakeImage(target, p, size); err != nil {
			log.Printf("%s: making the image: %v", target, err)
			return nil
		}
		images[s.key()] = p
		mnt := filepath.Join(dir, fmt.Sprintf("fw-%d.mnt", i))
		cmd, err := s.start(target, p, mnt, true)
		if err != nil {
			log.Printf("%s: %s: %v", target, s.key(), err)
			return nil
		}
		daemons[s.key()] = live{cmd, mnt}
	}
	var rows []row
	for i, job := range fwJobs() {
		r := row{target: target, name: job.name, unit: "IOPS", higherBetter: true}
		runs := map[string][]float64{}
		once := func(s system) float64 {
			warm(images[s.key()])
			v, err := fioRun(job, daemons[s.key()].mnt, "--time_based", "--runtime="+strconv.Itoa(int(runtimeFlag.Seconds())),
				"--ramp_time=1", "--size="+strconv.FormatInt(size, 10))
			if err != nil {
				log.Printf("%s: %v", s.key(), err)
			}
			runs[s.key()] = append(runs[s.key()], v)
			return v
		}
		for _, s := range rotate(systems, i) {
			r.add(s, once(s))
		}
		if best := r.qemuConfig; *reps > 1 && best != "" {
			for rep := 1; rep < *reps; rep++ {
				for _, s := range rotate(systems, i+rep) {
					if s.ours || s.key() == best {
						once(s)
					}
				}
			}
			for _, s := range systems {
				if s.ours {
					r.ours = median(runs[s.key()])
				}
				if s.ours || s.key() == best {
					log.Printf("  %-34s %s: %v", r.name, s.key(), runs[s.key()])
				}
			}
			r.qemu = median(runs[best])
		}
		logRow(r)
		rows = append(rows, r)
	}
	return rows
}

// fwAllocating is the rows of allocating writes: for each job and
// system, a fresh dynamic image of size bytes and fwAllocIOs random 4
// KiB writes into it (scaled down with -formatwrite-size).
func fwAllocating(target, dir string, size int64, systems []system) []row {
	f := fwFormats[target]
	log.Printf("target %s new (%s, empty, allocating writes)", target, sizeName(size))
	ios := max(64, int(int64(fwAllocIOs)*size/(16<<30)))
	var rows []row
	for i, job := range fwJobs() {
		r := row{target: target + " new", name: job.name + " (allocating)", unit: "IOPS", higherBetter: true}
		for _, s := range rotate(systems, i) {
			img := filepath.Join(dir, "fw-alloc."+f.format)
			mnt := filepath.Join(dir, "fw-alloc.mnt")
			if err := run("qemu-img", "create", "-q", "-f", f.format, "-o", f.opts, img, strconv.FormatInt(size, 10)); err != nil {
				log.Printf("%s: %v", target, err)
				return rows
			}
			cmd, err := s.start(target, img, mnt, true)
			if err != nil {
				log.Printf("%s: %s: %v", target, s.key(), err)
				os.Remove(img)
				r.add(s, 0)
				continue
			}
			t0 := time.Now()
			v, err := fioCount(job, mnt, strconv.FormatInt(size, 10), ios)
			if err != nil {
				log.Printf("%s: %v", s.key(), err)
			}
			stop(cmd, mnt)
			log.Printf("  %-34s %s: %.0f IOPS (%d writes, %.1f s)", r.name, s.key(), v, ios, time.Since(t0).Seconds())
			os.Remove(img)
			r.add(s, v)
		}
		logRow(r)
		rows = append(rows, r)
	}
	return rows
}

// fwQsdArgs are qemu-storage-daemon's --blockdev arguments for a
// formatwrite target (file node fileNode, the format's node "q",
// writable), or nil for another target.
func fwQsdArgs(target, fileNode string) []string {
	f, ok := fwFormats[strings.TrimSuffix(target, " new")]
	if !ok {
		return nil
	}
	return []string{"--blockdev", fileNode, "--blockdev", f.format + ",node-name=q,file=f"}
}
