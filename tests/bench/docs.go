package main

import (
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
)

// docs/bench/README.md quotes one current table per area. Each table sits
// between two markers,
//
//	<!-- bench:begin AREA -->
//	From [STAMP](STAMP.md): what the area measures. Machine: ...
//
//	| target | row | ... |
//	<!-- bench:end AREA -->
//
// and a run rewrites the blocks of the areas it measured whole, so that the
// page is never a hand copy of a report that has drifted from it.

// docArea is one marked block of the README: id names its markers and tags
// the rows that fill it (row.area); what is its "From" line's description.
type docArea struct {
	id, what string
}

// docAreas lists the README's blocks in its order. The ids are the -only
// targets that fill them. The descriptions read the flags that change what a block measured.
func docAreas() []docArea {
	const fio4k = "fio 4 KiB (aio = libaio iodepth 16, sync = pvsync2 iodepth 1), 1 MiB bandwidth, peak RSS"
	return []docArea{
		{"null", "the null device, writable: " + fio4k + "; the sync rows again with `--poll-us 50`"},
		{"raw", "a 1 GiB raw image, writable: " + fio4k + "; `qemu-img convert -n` of 1 GiB into the export"},
		{"qcow2", "a 1 GiB qcow2 image, writable: " + fio4k + "; allocating writes into a new 64 GiB image (`qcow2 new`)"},
		{"slow", "`--cache none` against QEMU with `cache.direct=on`, and reads with every cache dropped first"},
		{"nbd", "`blockexport nbd` against qemu-storage-daemon's NBD export and qemu-nbd, fio's nbd engine"},
		{"nbdsrc", "a FUSE export of an image on `qemu-nbd --aio=io_uring --shared=16` (unix socket) against qemu-storage-daemon's nbd blockdev under its FUSE export and nbdfuse"},
		{"kcache", "1 GiB raw, caches dropped before each row, fio psync buffered; `raw kcache` is `--kernel-cache on`; the last rows are the O_DIRECT matrix with `--kernel-cache on` against `off`"},
		{"loop", fmt.Sprintf("copy a 270 MB tree of 15,000 files into ext4 on a loop device over the export and `sync`, read it back with caches dropped, `e2fsck -f`; %d runs of every system (`-loop-reps %d`), medians", *loopReps, *loopReps)},
		{"formats", "1 GiB of random data converted by qemu-img to each format, page-cached, exported read-only, fio 4 KiB reads; the last rows read a streamOptimized vmdk through `--decompressed-cache-size 1280M`, read once first"},
		{"http", "a 1 GiB image on nginx on loopback, cold (caches dropped, default `--cache-size`) and warm (`--cache-size 1280M`, read once first), against nbdkit's curl plugin behind nbdfuse in several configurations and qemu-storage-daemon's curl node"},
		{"s3", "a 1 GiB object in versitygw on loopback, cold and warm; QEMU has no S3 driver, so there is nothing to compare with and the ratio column is empty"},
		{"convert", "`blockexport convert`/`compare` against `qemu-img` on 4 GiB images, page-cached, each tool's best of two; the rows to vhdx, vpc and vdi beside fio's sequential write of the same 2 GiB to the same disk (the report's device table)"},
		{"formatwrite", fmt.Sprintf("fio 4 KiB random writes (aio = libaio iodepth 16, sync = pvsync2 iodepth 1, O_DIRECT) through `fuse -w` of a %s image of each format written in place whose every block holds data (`FMT -w`), and into a fresh dynamic image 16 times as large (`FMT -w new`, %d writes), against qemu-storage-daemon's writable FUSE export of the same image", *fwSize, fwAllocIOs)},
		{"daemon", fmt.Sprintf("%d qcow2 images of %s (1 MiB written) added with `blockdev-add` and exported with `block-export-add` over FUSE in one daemon, each read (four 4 KiB reads), then `block-export-del` (its event awaited) and `blockdev-del`, %d rounds, over QMP with go-qemu's client, against qemu-storage-daemon (its default aio=threads); RSS with every export up (the highest round), ms per image, and the descriptors, threads and mounts left beyond the start; then fio 4 KiB random reads and 1 MiB bandwidth through a daemon export against the one-shot `blockexport fuse` of the same image", daemonExports, daemonImageSize, daemonRounds)},
		{"verbs", fmt.Sprintf("`measure` and `info` of a %s sparse qcow2 with 1 MiB in every GiB, wall time per call, the median of %d calls of each program taking turns; `commit` and `rebase` (safe onto another base, and `-b ''`) of a %s chain (raw base of random data, qcow2 top with every other cluster rewritten), rebuilt before each run, each cache mode's best of two, until `sync` returns, beside fio writing the same bytes sequentially (the disk's speed, in the report's table against the device)", *vbMeasureSize, *vbCalls, *vbChainSize)},
	}
}

// tag sets the README block of rows: several areas make rows of the same
// target (the kcdirect rows are raw rows too), so
// the target cannot say which block a row fills.
func tag(area string, rows []row) []row {
	for i := range rows {
		rows[i].area = area
	}
	return rows
}

// updateReadme rewrites, in the README at path, the blocks of the areas in
// covered (those this run measured whole) that have rows, from the run's
// rows as the report renders them; the rest of the page stays as it is. It
// returns the areas it rewrote, in the page's order.
func updateReadme(path, stamp, machine string, rows []row, covered map[string]bool) ([]string, error) {
	blocks := map[string]string{}
	var areas []string
	for _, a := range docAreas() {
		if !covered[a.id] {
			continue
		}
		var own []row
		for _, r := range rows {
			if r.area == a.id {
				own = append(own, r)
			}
		}
		// An area that ran but made no rows (its tools missing, say)
		// keeps the table it has rather than get an empty one.
		if len(own) == 0 {
			continue
		}
		areas = append(areas, a.id)
		blocks[a.id] = fmt.Sprintf("From [%s](%s.md): %s. %s\n\n%s", stamp, stamp, a.what, machine, ratioTable(own))
	}
	if len(blocks) == 0 {
		return nil, nil
	}
	old, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	updated, err := replaceBlocks(string(old), blocks)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return areas, os.WriteFile(path, []byte(updated), 0o644)
}

// markerLine is one marker, alone on its line.
var markerLine = regexp.MustCompile(`^<!-- bench:(begin|end) ([a-z0-9-]+) -->$`)

// replaceBlocks replaces what lies between the markers of each area in
// blocks with its text (ended by a newline if it is not), leaving every
// other byte of readme as it is. It refuses a page whose markers do not
// pair up (an end without its begin, a begin left open, blocks nested or
// an area marked twice) or that lacks a block it is given, rather than
// guess where a table goes.
func replaceBlocks(readme string, blocks map[string]string) (string, error) {
	var out strings.Builder
	seen := map[string]bool{}
	open := "" // the area whose block we are in
	for i, line := range strings.SplitAfter(readme, "\n") {
		text := strings.TrimSuffix(strings.TrimSuffix(line, "\n"), "\r")
		m := markerLine.FindStringSubmatch(text)
		// A line that starts like a marker and is not one is a typo that
		// would leave a block unmarked; prose may quote markers mid-line.
		if m == nil && strings.HasPrefix(strings.TrimSpace(text), "<!-- bench:") {
			return "", fmt.Errorf("line %d: malformed marker %q (want <!-- bench:begin AREA --> or <!-- bench:end AREA --> alone on a line)", i+1, text)
		}
		switch {
		case m == nil:
			// Outside a block, or in one this run leaves as it is.
			if _, replacing := blocks[open]; open == "" || !replacing {
				out.WriteString(line)
			}
		case m[1] == "begin":
			if open != "" {
				return "", fmt.Errorf("line %d: %s begins inside %s", i+1, m[2], open)
			}
			if seen[m[2]] {
				return "", fmt.Errorf("line %d: %s is marked twice", i+1, m[2])
			}
			open, seen[m[2]] = m[2], true
			out.WriteString(line)
			if block, ok := blocks[open]; ok {
				out.WriteString(block)
				if !strings.HasSuffix(block, "\n") {
					out.WriteString("\n")
				}
			}
		default:
			if open != m[2] {
				return "", fmt.Errorf("line %d: end of %s without its begin", i+1, m[2])
			}
			open = ""
			out.WriteString(line)
		}
	}
	if open != "" {
		return "", fmt.Errorf("%s begins and never ends", open)
	}
	for _, area := range slices.Sorted(maps.Keys(blocks)) {
		if !seen[area] {
			return "", fmt.Errorf("no block for %s (want <!-- bench:begin %s --> ... <!-- bench:end %s -->)", area, area, area)
		}
	}
	return out.String(), nil
}
