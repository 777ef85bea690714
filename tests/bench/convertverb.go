package main

import (
	"flag"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/blockexport/blockexport/formats/registry"
)

// The convert and compare verbs (-only convert): blockexport convert and
// compare against qemu-img convert and compare at their best, on one 4
// GiB raw image with 50% holes (1 MiB of data every 2 MiB: half random,
// half a few letters, so that compression has work) and the qcow2 and
// streamOptimized vmdk copies qemu-img makes of it. Each configuration
// runs twice and keeps the faster (the first run after other work pays
// for the page cache's write-back). The rows that write vhdx, vpc and vdi
// are bound by the disk, not the CPU: beside them (row.file), fio's own
// sequential write of the source's data bytes into the same directory,
// timed as the converts are (until the bytes are on disk).

// cvSize is the source's virtual size: 4 GiB; smaller only to check that
// the rows run (their figures then mean nothing).
var cvSize = flag.String("convert-size", "4G", "convert rows: the source's virtual size (default 4G; smaller only to check that the rows run)")

// cvSourceSize is -convert-size in bytes, a whole number of the source's
// 2 MiB strides.
func cvSourceSize() int64 {
	n, err := registry.ParseSize(*cvSize)
	if err != nil || n < 2<<20 || n%(2<<20) != 0 {
		log.Fatalf("-convert-size %q: want a multiple of 2 MiB", *cvSize)
	}
	return n
}

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
	size := cvSourceSize()
	log.Printf("convert and compare (%s, 50%% holes)", sizeName(size))
	src := filepath.Join(dir, "cv-src.raw")
	if err := cvMakeSource(src, size); err != nil {
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
	stream := []string{"-o", "subformat=streamOptimized"}
	cases := []struct {
		name, src, srcFmt, outFmt string
		extra                     []string
		// disk: the row is the disk's to bound; fio's sequential write
		// of the same bytes is measured beside it (row.file).
		disk bool
	}{
		{"raw 50% holes -> qcow2", src, "raw", "qcow2", nil, false},
		{"raw 50% holes -> qcow2 -c zstd", src, "raw", "qcow2", []string{"-c", "-o", "compression_type=zstd"}, false},
		{"raw 50% holes -> qcow2 -c zlib", src, "raw", "qcow2", []string{"-c"}, false},
		{"qcow2 -> raw", qsrc, "qcow2", "raw", nil, false},
		{"vmdk streamOptimized -> qcow2", vsrc, "vmdk", "qcow2", nil, false},
		// Issue 47's rows: streamOptimized grains deflated on every core
		// (target 1.5x qemu-img convert -m 16 -W); vhdx, vpc and vdi at
		// the disk's speed (never slower than qemu-img).
		{"raw 50% holes -> vmdk streamOptimized", src, "raw", "vmdk", stream, false},
		{"qcow2 -> vmdk streamOptimized", qsrc, "qcow2", "vmdk", stream, false},
		{"raw 50% holes -> vhdx", src, "raw", "vhdx", nil, true},
		{"raw 50% holes -> vpc", src, "raw", "vpc", nil, true},
		{"raw 50% holes -> vdi", src, "raw", "vdi", nil, true},
	}
	// disk is fio's time for the source's data bytes, measured once for
	// the rows that want it (0: none wanted it, or fio failed).
	disk := -1.0
	var rows []row
	for _, c := range cases {
		if !cvPicked(c.name) {
			continue
		}
		r := row{target: "convert", name: c.name + " (s)", unit: "s"}
		if c.disk {
			if disk < 0 {
				disk = cvBest(func() (float64, error) { return cvDiskWrite(dst, size/2) })
				log.Printf("  fio: sequential write of %s (the source's data) into %s: %.2f s", sizeName(size/2), dir, disk)
			}
			r.file = disk
		}
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
	r := row{target: "compare", name: "compare raw vs qcow2 " + sizeName(size) + " (s)", unit: "s"}
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

// cvDiskWrite times fio's sequential write of n bytes (1 MiB writes,
// psync, through the page cache as the converts write without -t none)
// into dst, until they are on disk (end_fsync, and cvTime's sync): the
// disk's speed for what a convert to a format of no compression writes.
func cvDiskWrite(dst string, n int64) (float64, error) {
	return cvTime(dst, "fio", "--name=disk", "--filename="+dst, "--rw=write", "--bs=1M", "--ioengine=psync",
		"--size="+strconv.FormatInt(n, 10), "--refill_buffers", "--end_fsync=1", "--output=/dev/null")
}

// sizeName is n bytes as a row names it: "4 GiB", "64 MiB".
func sizeName(n int64) string {
	if n >= 1<<30 && n%(1<<30) == 0 {
		return fmt.Sprintf("%d GiB", n>>30)
	}
	return fmt.Sprintf("%d MiB", n>>20)
}

// cvMakeSource writes the sparse source of size bytes.
func cvMakeSource(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		return err
	}
	r := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 1<<20)
	for off := int64(0); off < size; off += 2 << 20 {
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
