package main

import (
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// benchKernelCache runs issue 29's table: buffered (no O_DIRECT) fio psync
// over 1 GiB, caches dropped before each row and system, against the raw
// file itself (the ceiling), qemu-storage-daemon (which sets no direct_io,
// so the kernel caches for it) and blockexport --kernel-cache on, with
// and without --cache none under it (one cache or two). Beside each read
// row, the page cache the row left behind (MiB of "Cached" in
// /proc/meminfo grown over the run): the kernel's cache of the export,
// plus the host file's when both are kept.
func benchKernelCache(dir string, ours func(extra ...string) system) []row {
	log.Printf("target raw (kernel cache: buffered, cold)")
	img := filepath.Join(dir, "kcache.raw")
	ceiling := filepath.Join(dir, "kcache-ceiling.raw")
	for _, p := range []string{img, ceiling} {
		if err := makeImage("raw", p); err != nil {
			log.Fatal(err)
		}
	}
	defer os.Remove(img)
	defer os.Remove(ceiling)
	cached := ours("--kernel-cache", "on")
	oneCache := ours("--kernel-cache", "on", "--cache", "none")
	oneCache.ours, oneCache.config = false, "--kernel-cache on --cache none"
	file := system{name: "file"}
	systems := append([]system{cached, oneCache, file}, qsdSystems("raw")...)
	jobs := []struct {
		job  fioJob
		args []string
	}{
		{fioJob{"W 4 KiB seq buffered, end_fsync (MiB/s)", "write", "psync", "4k", 1}, []string{"--end_fsync=1"}},
		{fioJob{"R 4 KiB seq buffered (MiB/s)", "read", "psync", "4k", 1}, nil},
		{fioJob{"R 1 MiB seq buffered (MiB/s)", "read", "psync", "1M", 1}, nil},
	}
	var rows []row
	for i, j := range jobs {
		r := row{target: "raw kcache", name: j.job.name, unit: "MiB/s", higherBetter: true}
		mem := row{target: "raw kcache", name: j.job.name + " page cache (MiB)", unit: "MiB"}
		for _, s := range rotate(systems, i) {
			v, grown, err := kcRun(s, j.job, j.args, img, ceiling)
			if err != nil {
				log.Printf("%s: %v", s.key(), err)
			}
			if s.name == "file" {
				r.file, mem.file = v, grown
				continue
			}
			r.add(s, v)
			mem.add(s, grown)
		}
		log.Printf("  %-44s qemu %8.1f (%s)  ours %8.1f  x%.2f  file %8.1f  ours/file %.2f", r.name, r.qemu, r.qemuConfig, r.ours, ratio(r), r.file, r.ours/max(r.file, 1))
		rows = append(rows, r)
		if j.job.rw == "read" {
			rows = append(rows, mem)
		}
	}
	return rows
}

// kcRun measures one system on one buffered job: the daemon starts on
// img (the file row runs on ceiling itself), caches are dropped, fio
// reads or writes 1 GiB, and the page cache it grew is measured before
// the daemon stops. 4 KiB rows report MiB/s too.
func kcRun(s system, job fioJob, extra []string, img, ceiling string) (mibs, cacheGrown float64, err error) {
	target := ceiling
	if s.name != "file" {
		mnt := img + ".mnt"
		cmd, err := s.start("raw", img, mnt, true)
		if err != nil {
			return 0, 0, err
		}
		defer stop(cmd, mnt)
		target = mnt
	}
	run("sync")
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
		return 0, 0, fmt.Errorf("dropping caches: %w", err)
	}
	before := kcMeminfoCached()
	args := append([]string{"--size=1G", "--direct=0"}, extra...)
	v, err := fioRun(job, target, args...)
	if err != nil {
		return 0, 0, err
	}
	if job.bs != "1M" {
		v = v * 4 / 1024 // IOPS of 4 KiB: MiB/s, as the table
	}
	return v, max(kcMeminfoCached()-before, 0), nil
}

// kcMeminfoCached is "Cached" of /proc/meminfo in MiB.
func kcMeminfoCached() float64 {
	b, _ := os.ReadFile("/proc/meminfo")
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "Cached:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	return 0
}
