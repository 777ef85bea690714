// Command bench measures blockexport against qemu-storage-daemon's FUSE
// export on the same machine in one run, over the matrix QEMU's authors
// publish (4 KiB; "aio" = libaio iodepth 16, "sync" = pvsync2 iodepth 1;
// seq/rand x read/write; direct I/O; one job; time-based) on a null device,
// a raw image and a qcow2 image, plus 1 MiB sequential bandwidth, the wall
// time of `qemu-img convert -n` of a 1 GiB image into each export, and each
// daemon's peak RSS. Rows alternate between the two systems so drift hits
// both. It reports; it never fails on a ratio.
//
// It also runs fio's nbd engine against both NBD servers (null and raw).
//
//	go run ./tests/bench [-runtime 5s] [-out docs/bench] [-only null,raw,qcow2,nbd]
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

type system struct {
	name  string
	start func(target, image, mnt string, writable bool) (*exec.Cmd, error)
}

type row struct {
	target, name string
	unit         string // "IOPS", "MiB/s", "s", "MiB"
	qemu, ours   float64
	higherBetter bool
}

var (
	runtimeFlag = flag.Duration("runtime", 5*time.Second, "fio runtime per row and system")
	outDir      = flag.String("out", "docs/bench", "where the report goes")
	only        = flag.String("only", "null,raw,qcow2", "targets to run (null, raw, qcow2; nbd for the NBD rows alone)")
	binFlag     = flag.String("bin", "bin/blockexport", "blockexport binary")
	workDir     = flag.String("dir", "", "scratch directory for images (default: a temp dir)")
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
		return system{"blockexport", func(target, image, mnt string, writable bool) (*exec.Cmd, error) {
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
			}
			return startAndWait(exec.Command(bin, append(args, mnt)...), mnt)
		}}
	}
	systems := []system{{"qemu-storage-daemon", startQSD}, ours()}
	var rows []row
	for _, target := range strings.Split(*only, ",") {
		if target != "nbd" {
			rows = append(rows, benchTarget(target, dir, systems, "", nil)...)
		}
	}
	if strings.Contains(*only, "null") && *only != "nbd" {
		// The opt-in busy-poll mode, on the rows it is for.
		polled := []system{systems[0], ours("--poll-us", "50")}
		rows = append(rows, benchTarget("null", dir, polled, " (--poll-us 50)", func(j fioJob) bool { return j.engine == "pvsync2" })...)
	}
	if strings.Contains(*only, "qcow2") {
		rows = append(rows, benchAlloc(dir, systems)...)
	}
	if *only != "nbd" {
		rows = append(rows, benchConvert(dir, systems)...)
	}
	if strings.Contains(*only, "raw") {
		rows = append(rows, benchPassthrough(dir, bin)...)
	}
	if strings.Contains(*only, "nbd") || *only == "null,raw,qcow2" {
		for _, target := range []string{"null", "raw"} {
			rows = append(rows, benchNBD(target, dir, bin)...)
		}
	}
	if err := report(rows); err != nil {
		log.Fatal(err)
	}
}

func startQSD(target, image, mnt string, writable bool) (*exec.Cmd, error) {
	var blockdev []string
	node := "n"
	switch target {
	case "null":
		blockdev = []string{"--blockdev", "null-co,node-name=n,size=1073741824,read-zeroes=on"}
	case "raw":
		blockdev = []string{"--blockdev", "file,node-name=n,filename=" + image}
	case "qcow2":
		blockdev = []string{"--blockdev", "file,node-name=f,filename=" + image, "--blockdev", "qcow2,node-name=q,file=f"}
		node = "q"
	}
	w := "off"
	if writable {
		w = "on"
	}
	args := append(blockdev, "--export", fmt.Sprintf("fuse,id=e,node-name=%s,mountpoint=%s,writable=%s", node, mnt, w))
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
	if target == "qcow2" {
		rawPath = path + ".src"
	}
	if err := run("fio", "--name=fill", "--filename="+rawPath, "--rw=write", "--bs=1M", "--size=1G",
		"--ioengine=psync", "--refill_buffers", "--output=/dev/null"); err != nil {
		return err
	}
	if target == "qcow2" {
		defer os.Remove(rawPath)
		return run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=65536", rawPath, path)
	}
	return nil
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
	images := map[string]string{}
	for _, s := range systems {
		if target == "null" {
			continue
		}
		p := filepath.Join(dir, target+"-"+s.name+".img")
		if err := makeImage(target, p); err != nil {
			log.Fatal(err)
		}
		images[s.name] = p
	}
	// Both sides write (qcow2: into the allocated clusters of a full
	// image; allocating writes have rows of their own, benchAlloc).
	writable := true
	type live struct {
		cmd *exec.Cmd
		mnt string
	}
	daemons := map[string]live{}
	for _, s := range systems {
		mnt := filepath.Join(dir, target+"-"+s.name+".mnt")
		cmd, err := s.start(target, images[s.name], mnt, writable)
		if err != nil {
			log.Fatal(err)
		}
		daemons[s.name] = live{cmd, mnt}
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
		// Alternate which system goes first.
		order := []system{systems[0], systems[1]}
		if i%2 == 1 {
			order = []system{systems[1], systems[0]}
		}
		for _, s := range order {
			warm(images[s.name])
			v, err := fio(job, daemons[s.name].mnt)
			if err != nil {
				log.Printf("%s: %v", s.name, err)
			}
			r.set(s.name == "blockexport", v)
		}
		logRow(r)
		rows = append(rows, r)
	}
	if keep != nil {
		return rows
	}
	rss := row{target: target, name: "peak RSS (MiB)", unit: "MiB"}
	rss.qemu = peakRSS(daemons["qemu-storage-daemon"].cmd.Process.Pid)
	rss.ours = peakRSS(daemons["blockexport"].cmd.Process.Pid)
	return append(rows, rss)
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
		order := []system{systems[0], systems[1]}
		if i%2 == 1 {
			order = []system{systems[1], systems[0]}
		}
		for _, s := range order {
			img := filepath.Join(dir, "alloc-"+s.name+".qcow2")
			mnt := filepath.Join(dir, "alloc-"+s.name+".mnt")
			if err := run("qemu-img", "create", "-q", "-f", "qcow2", img, "64G"); err != nil {
				log.Fatal(err)
			}
			cmd, err := s.start("qcow2", img, mnt, true)
			if err != nil {
				log.Fatal(err)
			}
			v, err := fioCount(job, mnt, "64G", allocIOs)
			if err != nil {
				log.Printf("%s: %v", s.name, err)
			}
			stop(cmd, mnt)
			os.Remove(img)
			r.set(s.name == "blockexport", v)
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
	for _, s := range systems {
		dst := filepath.Join(dir, "convert-dst-"+s.name+".img")
		f, _ := os.Create(dst)
		f.Truncate(1 << 30)
		f.Close()
		mnt := dst + ".mnt"
		cmd, err := s.start("raw", dst, mnt, true)
		if err != nil {
			log.Fatal(err)
		}
		warm(src)
		t0 := time.Now()
		err = run("qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, mnt)
		took := time.Since(t0).Seconds()
		stop(cmd, mnt)
		os.Remove(dst)
		if err != nil {
			log.Printf("%s: %v", s.name, err)
		}
		r.set(s.name == "blockexport", took)
	}
	log.Printf("  convert: qemu %.2fs ours %.2fs", r.qemu, r.ours)
	return []row{r}
}

// ratio is ours over QEMU's, turned so that above 1 is better for us.
// set records one system's measurement.
func (r *row) set(ours bool, v float64) {
	if ours {
		r.ours = v
	} else {
		r.qemu = v
	}
}

// logRow prints a finished row.
func logRow(r row) {
	log.Printf("  %-22s qemu %10.0f  ours %10.0f  x%.2f", r.name, r.qemu, r.ours, ratio(r))
}

func ratio(r row) float64 {
	if r.qemu == 0 || r.ours == 0 {
		return 0
	}
	if r.higherBetter {
		return r.ours / r.qemu
	}
	return r.qemu / r.ours
}

func report(rows []row) error {
	if err := os.MkdirAll(*outDir, 0o755); err != nil {
		return err
	}
	stamp := time.Now().UTC().Format("2006-01-02T1504Z")
	var b strings.Builder
	fmt.Fprintf(&b, "# blockexport vs qemu-storage-daemon — %s\n\n", stamp)
	fmt.Fprintf(&b, "%s\n\n", machine())
	fmt.Fprintf(&b, "fio: 4 KiB, direct=1, numjobs=1, time_based, runtime %v (+1 s ramp) per row and system; aio = libaio iodepth 16, sync = pvsync2 iodepth 1. 1 GiB images, page cache warmed before each row. qemu-storage-daemon runs with its defaults (file nodes with aio=threads, page cache, no iothread), not tuned. Ratio > 1 means blockexport is better (for time and RSS rows: smaller).\n\n", *runtimeFlag)
	fmt.Fprintf(&b, "![ratios](%s.svg)\n\n", stamp)
	fmt.Fprintf(&b, "| target | row | qemu-storage-daemon | blockexport | ratio |\n|---|---|---:|---:|---:|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %.2f× |\n", r.target, r.name, num(r.qemu, r.unit), num(r.ours, r.unit), ratio(r))
	}
	md := filepath.Join(*outDir, stamp+".md")
	if err := os.WriteFile(md, []byte(b.String()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(*outDir, stamp+".svg"), []byte(chart(rows)), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(*outDir, "latest.md"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	fmt.Print(b.String())
	log.Printf("report: %s", md)
	return nil
}

func num(v float64, unit string) string {
	switch unit {
	case "IOPS":
		return fmt.Sprintf("%.1fk", v/1000)
	case "s":
		return fmt.Sprintf("%.2f s", v)
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

// benchNBD runs fio's nbd engine (4 KiB, iodepth 16) against both NBD
// servers on a unix socket: qemu-storage-daemon's NBD export and
// blockexport nbd, on the null device or the same kind of raw file.
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
	start := func(name string) (*exec.Cmd, string) {
		sock := filepath.Join(dir, name+".sock")
		os.Remove(sock)
		var cmd *exec.Cmd
		if name == "qemu-storage-daemon" {
			node := "null-co,node-name=n,size=1073741824,read-zeroes=on"
			if target == "raw" {
				node = "file,node-name=n,filename=" + image
			}
			cmd = exec.Command("qemu-storage-daemon", "--blockdev", node,
				"--nbd-server", "addr.type=unix,addr.path="+sock, "--export", "nbd,id=e,node-name=n,writable=on,name=")
		} else {
			spec := "null:1G"
			if target == "raw" {
				spec = image
			}
			cmd = exec.Command(bin, "nbd", "--log-level", "warn", "-w", "-f", map[string]string{"null": "null", "raw": "raw"}[target], "--listen", "unix:"+sock, spec)
		}
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			log.Fatal(err)
		}
		for i := 0; i < 500; i++ {
			if _, err := os.Stat(sock); err == nil {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		return cmd, "nbd+unix:///?socket=" + sock
	}
	q, quri := start("qemu-storage-daemon")
	o, ouri := start("blockexport")
	defer func() {
		for _, c := range []*exec.Cmd{q, o} {
			c.Process.Signal(syscall.SIGTERM)
			c.Wait()
		}
	}()
	var rows []row
	for i, rw := range []string{"read", "randread", "write", "randwrite"} {
		r := row{target: "nbd " + target, name: rw + " 4k iodepth 16", unit: "IOPS", higherBetter: true}
		uris := [][2]string{{"q", quri}, {"o", ouri}}
		if i%2 == 1 {
			uris[0], uris[1] = uris[1], uris[0]
		}
		for _, u := range uris {
			warm(image)
			v, err := fioNBD(rw, u[1])
			if err != nil {
				log.Print(err)
			}
			r.set(u[0] == "o", v)
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

// benchPassthrough compares reads through a --passthrough export with fio
// on the image file itself (the "qemu" column holds the native file here).
func benchPassthrough(dir, bin string) []row {
	log.Printf("target raw passthrough vs native file")
	img := filepath.Join(dir, "pt.img")
	if err := makeImage("raw", img); err != nil {
		log.Fatal(err)
	}
	defer os.Remove(img)
	mnt := img + ".mnt"
	cmd, err := startAndWait(exec.Command(bin, "fuse", "--log-level", "warn", "-f", "raw", "--passthrough", "on", img, mnt), mnt)
	if err != nil {
		log.Printf("passthrough: %v", err)
		return nil
	}
	defer stop(cmd, mnt)
	var rows []row
	for _, job := range matrix() {
		if strings.Contains(job.rw, "write") || job.bs != "4k" {
			continue
		}
		r := row{target: "raw passthrough", name: job.name + " (vs the file itself)", unit: "IOPS", higherBetter: true}
		warm(img)
		r.qemu, _ = fio(job, img)
		warm(img)
		r.ours, _ = fio(job, mnt)
		log.Printf("  %-22s file %10.0f  ours %10.0f  x%.2f", job.name, r.qemu, r.ours, ratio(r))
		rows = append(rows, r)
	}
	return rows
}
