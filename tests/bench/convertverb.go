package main

import (
	"flag"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// The convert and compare verbs (-only convert): blockexport convert and
// compare against qemu-img convert and compare at their best, on one 4
// GiB raw image with 50% holes (1 MiB of data every 2 MiB: half random,
// half a few letters, so that compression has work) and the qcow2 and
// streamOptimized vmdk copies qemu-img makes of it. Each configuration
// runs twice and keeps the faster (the first run after other work pays
// for the page cache's write-back).

// cvBenchSize is the source's virtual size.
const cvBenchSize = 4 << 30

// cvQemuConverts are the qemu-img convert configurations tried; the row
// quotes the fastest and names it. -t none is only for targets QEMU can
// open with O_DIRECT (all here).
// cvRows picks convert rows by name: comma-separated words, one of which
// a row's name must contain, or, starting with "!", none of which it
// may; empty: all.
var cvRows = flag.String("convert-rows", "", "convert rows to run: words one of which a row's name contains, !word for rows without it (e.g. \"!zlib\"); default all")

// cvPicked says whether the convert row name is to run.
func cvPicked(name string) bool {
	picked, wanted := false, false
	for _, w := range strings.Split(*cvRows, ",") {
		switch {
		case w == "":
		case strings.HasPrefix(w, "!"):
			if strings.Contains(name, w[1:]) {
				return false
			}
		default:
			wanted = true
			picked = picked || strings.Contains(name, w)
		}
	}
	return picked || !wanted
}

var cvQemuConverts = [][]string{{"-m", "8"}, {"-m", "16", "-W"}, {"-m", "16", "-W", "-t", "none"}}

// cvOurConverts are ours; the row keeps the fastest.
var cvOurConverts = [][]string{{"-m", "16", "-W"}, {"-m", "16", "-W", "-t", "none"}}

func cvBenchConvert(dir, bin string) []row {
	log.Printf("convert and compare (4 GiB, 50%% holes)")
	src := filepath.Join(dir, "cv-src.raw")
	if err := cvMakeSource(src); err != nil {
		log.Fatal(err)
	}
	defer os.Remove(src)
	qsrc := filepath.Join(dir, "cv-src.qcow2")
	vsrc := filepath.Join(dir, "cv-src.vmdk")
	if err := run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", src, qsrc); err != nil {
		log.Fatal(err)
	}
	defer os.Remove(qsrc)
	if err := run("qemu-img", "convert", "-f", "raw", "-O", "vmdk", "-o", "subformat=streamOptimized", src, vsrc); err != nil {
		log.Fatal(err)
	}
	defer os.Remove(vsrc)
	dst := filepath.Join(dir, "cv-dst")
	cases := []struct {
		name, src, srcFmt, outFmt string
		extra                     []string
	}{
		{"raw 50% holes -> qcow2", src, "raw", "qcow2", nil},
		{"raw 50% holes -> qcow2 -c zstd", src, "raw", "qcow2", []string{"-c", "-o", "compression_type=zstd"}},
		{"raw 50% holes -> qcow2 -c zlib", src, "raw", "qcow2", []string{"-c"}},
		{"qcow2 -> raw", qsrc, "qcow2", "raw", nil},
		{"vmdk streamOptimized -> qcow2", vsrc, "vmdk", "qcow2", nil},
	}
	var rows []row
	for _, c := range cases {
		if !cvPicked(c.name) {
			continue
		}
		r := row{target: "convert", name: c.name + " (s)", unit: "s"}
		for _, q := range cvQemuConverts {
			args := append(append([]string{"convert", "-f", c.srcFmt, "-O", c.outFmt}, c.extra...), q...)
			v := cvBest(func() (float64, error) { return cvTime(dst, "qemu-img", append(args, c.src, dst)...) })
			r.add(system{name: "qemu-img convert", config: fmt.Sprint(q)}, v)
		}
		best := 0.0
		for _, o := range cvOurConverts {
			args := append(append([]string{"convert", "-f", c.srcFmt, "-O", c.outFmt}, c.extra...), o...)
			v := cvBest(func() (float64, error) { return cvTime(dst, bin, append(args, c.src, dst)...) })
			// Which of ours was fastest is in the log only (the row keeps
			// the best): -t none wins where the disk, not the CPU, bounds.
			log.Printf("  %s: blockexport %v: %.2f s", c.name, o, v)
			if v != 0 && (best == 0 || v < best) {
				best = v
			}
		}
		r.add(system{name: "blockexport", ours: true}, best)
		logRow(r)
		rows = append(rows, r)
	}
	// compare: the raw source against its qcow2 copy, both 4 GiB.
	r := row{target: "compare", name: "compare raw vs qcow2 4 GiB (s)", unit: "s"}
	r.add(system{name: "qemu-img compare", config: "default"},
		cvBest(func() (float64, error) {
			return cvTime("", "qemu-img", "compare", "-f", "raw", "-F", "qcow2", src, qsrc)
		}))
	r.add(system{name: "blockexport", ours: true},
		cvBest(func() (float64, error) { return cvTime("", bin, "compare", "-f", "raw", "-F", "qcow2", src, qsrc) }))
	logRow(r)
	return append(rows, r)
}

// cvBest runs f twice and returns the faster time (0: both failed).
func cvBest(f func() (float64, error)) float64 {
	best := 0.0
	for range 2 {
		v, err := f()
		if err != nil {
			log.Print(err)
			continue
		}
		if best == 0 || v < best {
			best = v
		}
	}
	return best
}

// cvTime times one command; dst, when set, is removed before and after
// (and the write-back of the one before is not inherited: sync).
func cvTime(dst, prog string, args ...string) (float64, error) {
	if dst != "" {
		os.Remove(dst)
		defer os.Remove(dst)
	}
	run("sync")
	t0 := time.Now()
	err := run(prog, args...)
	took := time.Since(t0).Seconds()
	if err == nil && dst != "" {
		// The data must be on disk for the time to count it all.
		err = run("sync", dst)
		took = time.Since(t0).Seconds()
	}
	return took, err
}

// cvMakeSource writes the sparse 4 GiB source.
func cvMakeSource(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(cvBenchSize); err != nil {
		return err
	}
	r := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 1<<20)
	for off := int64(0); off < cvBenchSize; off += 2 << 20 {
		for i := range buf[:len(buf)/2] {
			buf[i] = byte(r.Uint32())
		}
		for i := len(buf) / 2; i < len(buf); i++ {
			buf[i] = 'a' + byte(r.IntN(4))
		}
		if _, err := f.WriteAt(buf, off); err != nil {
			return err
		}
	}
	return nil
}
