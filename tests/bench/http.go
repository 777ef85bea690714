package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// httpExporter is one way to present an http URL as a file: ours,
// nbdkit's curl plugin behind nbdfuse, or qemu-storage-daemon's curl
// driver under its FUSE export.
type httpExporter struct {
	s system
	// start mounts url at mnt; it returns the processes to stop (the
	// exporter last) and the file fio reads.
	start func(url, mnt string) ([]*exec.Cmd, string, error)
	// mount is what start mounted (a file, or nbdfuse's directory).
	mount func(mnt string) string
	// only: "cold" or "warm" when the exporter's figures count in those
	// rows alone (ours: its default cache for the cold rows, one that
	// holds the object for the warm ones); "" for both.
	only string
}

// httpNoProgress bounds one fio run on an exporter: QEMU 7.2's FUSE
// export over its curl driver makes no progress at queue depth 16 (its
// /dev/fuse handler reads synchronously, blk_pread in a nested aio_poll;
// the next request re-enters the handler inside that poll, and the
// innermost read waits on a curl transfer that nested poll never drives:
// seen with gdb, a stack of blk_pread frames over a ppoll of two fds).
// Past the bound the exporter is killed, so that fio's requests fail, and
// the run counts as failed (0).
var httpNoProgress = flag.Duration("http-stall", 90*time.Second, "http rows: how long one fio run may take before its exporter counts as making no progress and is killed")

// benchHTTP measures FUSE exports of a 1 GiB raw image served by nginx
// on loopback (the file in the page cache): 1 MiB sequential reads and
// 4 KiB random reads at libaio qd16 and pvsync2 qd1, each cold (a fresh
// export) and warm (the same I/Os again on that export). The compared-
// with column quotes the faster of nbdkit's curl plugin behind nbdfuse
// and qemu-storage-daemon's curl node (its default readahead, 256 KiB,
// and larger ones), named. Ours runs with its defaults (16 connections,
// a 64 MiB cache) in the cold rows, and with a cache that holds the
// object in the warm rows.
// httpReps is how many times ours and the fastest anchor run each http row.
var httpReps = flag.Int("http-reps", 3, "http rows: runs of ours and of the fastest anchor per row (the medians count; every other anchor configuration runs once)")

func benchHTTP(dir, bin string) []row {
	log.Printf("target http (nginx on loopback)")
	www := filepath.Join(dir, "www")
	if err := os.MkdirAll(www, 0o755); err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(www)
	img := filepath.Join(www, "disk.img")
	if err := makeImage("raw", img); err != nil {
		log.Fatal(err)
	}
	url, stopNginx := httpBenchNginx(dir, www)
	defer stopNginx()

	// Ours twice: with its defaults (a 64 MiB cache) for the cold rows,
	// and with a cache that holds the object (1280 MiB) for the warm
	// ones. A cold pass that fills a cache that large first touches a
	// GiB of fresh memory, which on this VM (every new page a host
	// fault, then cleared) cost a quarter of the daemon's CPU and 20-40%
	// of the cold 1 MiB row; the default cache reuses its buffers.
	var exporters []httpExporter
	for _, c := range []struct{ only, size string }{{"cold", ""}, {"warm", "1280M"}} {
		args := []string{"fuse", "--log-level", "warn", "-f", "raw"}
		if c.size != "" {
			args = append(args, "--cache-size", c.size)
		}
		exporters = append(exporters, httpExporter{
			s:    system{name: "blockexport", ours: true, config: strings.Join(args[3:], " ")},
			only: c.only,
			start: func(url, mnt string) ([]*exec.Cmd, string, error) {
				cmd, err := startAndWait(exec.Command(bin, append(args, url, mnt)...), mnt)
				return []*exec.Cmd{cmd}, mnt, err
			},
			mount: func(mnt string) string { return mnt },
		})
	}
	// readahead takes bytes, as an integer (7.2 refuses "1M").
	for _, ra := range []struct{ name, bytes string }{{"", ""}, {"1 MiB", "1048576"}, {"4 MiB", "4194304"}} {
		config := "curl node, readahead " + ra.name
		opt := ""
		if ra.bytes == "" {
			config = "curl node, default readahead (256 KiB)"
		} else {
			opt = ",readahead=" + ra.bytes
		}
		exporters = append(exporters, httpExporter{
			s: system{name: "qemu-storage-daemon", config: config},
			start: func(url, mnt string) ([]*exec.Cmd, string, error) {
				cmd, err := startAndWait(exec.Command("qemu-storage-daemon",
					"--blockdev", "driver=http,node-name=h,read-only=on,url="+url+opt,
					"--export", "fuse,id=e,node-name=h,mountpoint="+mnt), mnt)
				return []*exec.Cmd{cmd}, mnt, err
			},
			mount: func(mnt string) string { return mnt },
		})
	}
	// nbdkit as its users may run it: plain, with its readahead filter
	// (which prefetches ahead of sequential reads), or with its cache
	// filter keeping what it reads (cache-on-read=true: by default it
	// caches writes only), the readahead filter over it (readahead does
	// nothing over the curl plugin alone, which has no NBD_CMD_CACHE);
	// behind one or four nbdfuse connections. By hand on 12-06 the cache
	// filter ran cold random 4 KiB reads at qd16 at 9.8k against 7.9k
	// plain (it fetches 64 KiB blocks, which a second read of a block
	// then finds), and the warm 1 MiB row at 2060 MiB/s against 789.
	// The cow filter with cow-on-read=true keeps what it reads too, in
	// blocks whose size users may set (the cache filter's are fixed in
	// 1.32): by hand on 12-06 its 256 KiB blocks ran cold random 4 KiB
	// reads at qd16 at 10.2-12.5k, where 64 KiB ran 9.3k, 1 MiB 7.2-7.9k
	// and the cache filter 10.0k.
	cache := []string{"cache-on-read=true"}
	cow := []string{"cow-on-read=true", "cow-block-size=256K"}
	for _, nc := range []struct {
		conns   string
		filters []string
		params  []string // the filters' parameters
	}{{"1", nil, nil}, {"4", nil, nil}, {"1", []string{"readahead"}, nil}, {"4", []string{"readahead"}, nil},
		{"1", []string{"cache"}, cache}, {"4", []string{"cache"}, cache}, {"1", []string{"readahead", "cache"}, cache},
		{"1", []string{"cow"}, cow}, {"4", []string{"cow"}, cow}} {
		var flags []string
		for _, f := range nc.filters {
			flags = append(flags, "--filter="+f)
		}
		words := append(append([]string(nil), flags...), nc.params...)
		params := nc.params
		config := "nbdfuse -C " + nc.conns
		if len(words) > 0 {
			config = strings.Join(words, " ") + ", " + config
		}
		conns := nc.conns
		exporters = append(exporters, httpExporter{
			s: system{name: "nbdkit curl + nbdfuse", config: config},
			start: func(url, mnt string) ([]*exec.Cmd, string, error) {
				sock := mnt + ".sock"
				os.Remove(sock) // a killed nbdkit leaves its socket behind
				args := append([]string{"-f", "--exit-with-parent", "-U", sock}, flags...)
				args = append(append(args, "curl", "url="+url), params...)
				server := exec.Command("nbdkit", args...)
				server.Stderr = os.Stderr
				if err := server.Start(); err != nil {
					return nil, "", err
				}
				for k := 0; k < 500; k++ {
					if c, err := net.Dial("unix", sock); err == nil {
						c.Close()
						break
					}
					time.Sleep(20 * time.Millisecond)
				}
				d := mnt + ".d"
				os.Mkdir(d, 0o755)
				cmd := exec.Command("nbdfuse", "-C", conns, d, "nbd+unix:///?socket="+sock)
				cmd.Stderr = os.Stderr
				if err := cmd.Start(); err != nil {
					server.Process.Kill()
					server.Wait()
					return nil, "", err
				}
				for i := 0; i < 500 && !mounted(d); i++ {
					time.Sleep(20 * time.Millisecond)
				}
				if !mounted(d) {
					cmd.Process.Kill()
					cmd.Wait()
					server.Process.Kill()
					server.Wait()
					return nil, "", fmt.Errorf("nbdfuse did not mount %s", d)
				}
				return []*exec.Cmd{server, cmd}, filepath.Join(d, "nbd"), nil
			},
			mount: func(mnt string) string { return mnt + ".d" },
		})
	}

	// warmLoops: the warm pass of the sequential job reads the object
	// that many times over (the same I/Os, each pass whole): once, at
	// 3 GB/s, it lasted a third of a second, and the row's three runs
	// spread 1.0-2.9 GB/s on fio's start and end. The random jobs' warm
	// passes stay one: a second loop's offsets would not be the first's.
	jobs := []struct {
		job       fioJob
		size      string
		ios       int
		warmLoops int
	}{
		{fioJob{"R 1 MiB seq (MiB/s)", "read", "libaio", "1M", 16}, "1G", 1024, 4},
		{fioJob{"R rand aio", "randread", "libaio", "4k", 16}, "1G", 40000, 1},
		{fioJob{"R rand sync", "randread", "pvsync2", "4k", 1}, "1G", 10000, 1},
	}
	var rows []row
	for i, j := range jobs {
		unit := "IOPS"
		if j.job.bs == "1M" {
			unit = "MiB/s"
		}
		cold := row{target: "http", name: j.job.name + " cold", unit: unit, higherBetter: true}
		hot := row{target: "http --cache-size 1280M", name: j.job.name + " warm", unit: unit, higherBetter: true}
		// measure runs e once: a fresh export, the job cold, and (unless
		// e counts in the cold rows alone) the same I/Os again warm.
		measure := func(e httpExporter) (c, w float64) {
			warm(img)
			mnt := filepath.Join(dir, "http.mnt")
			cmds, file, err := e.start(url, mnt)
			if err != nil {
				log.Printf("%s: %v", e.s.key(), err)
				return 0, 0
			}
			// The same I/Os twice (fio repeats its random offsets): the
			// first pass is cold, the second finds what a cache kept.
			once := []string{"--size=" + j.size, "--number_ios=" + strconv.Itoa(j.ios)}
			again := once
			if j.warmLoops > 1 {
				again = []string{"--size=" + j.size, "--loops=" + strconv.Itoa(j.warmLoops)}
			}
			c = httpFio(j.job, file, cmds, e.mount(mnt), e.s.key()+" cold", once...)
			if c != 0 && e.only != "cold" {
				w = httpFio(j.job, file, cmds, e.mount(mnt), e.s.key()+" warm", again...)
			}
			for k := len(cmds) - 1; k >= 0; k-- {
				stop(cmds[k], e.mount(mnt))
			}
			return c, w
		}
		// As the kernel-cache rows: every configuration once, then ours
		// and the fastest anchor (cold and warm apart) httpReps-1 times
		// more, the order rotating, and the medians count (nbdkit's
		// plain -C 1 read 957 and 1209 MiB/s cold in two runs here: the
		// best of eight single runs would quote an anchor's luckiest
		// minute against ours once).
		coldRuns, warmRuns := map[string][]float64{}, map[string][]float64{}
		for _, e := range rotateHTTP(exporters, i) {
			c, w := measure(e)
			e.count(&cold, &hot, c, w)
			coldRuns[e.s.key()] = append(coldRuns[e.s.key()], c)
			warmRuns[e.s.key()] = append(warmRuns[e.s.key()], w)
		}
		bestCold, bestWarm := cold.qemuConfig, hot.qemuConfig
		for rep := 1; rep < *httpReps; rep++ {
			for _, e := range rotateHTTP(exporters, i+rep) {
				k := e.s.key()
				if !e.s.ours && k != bestCold && k != bestWarm {
					continue
				}
				c, w := measure(e)
				coldRuns[k] = append(coldRuns[k], c)
				warmRuns[k] = append(warmRuns[k], w)
			}
		}
		if *httpReps > 1 {
			for _, e := range exporters {
				k := e.s.key()
				switch {
				case e.s.ours && e.only == "cold":
					cold.ours = median(coldRuns[k])
				case e.s.ours && e.only == "warm":
					hot.ours = median(warmRuns[k])
				}
				if e.s.ours || k == bestCold || k == bestWarm {
					log.Printf("  %-34s %s: cold %v warm %v", j.job.name, k, coldRuns[k], warmRuns[k])
				}
			}
			if bestCold != "" {
				cold.qemu = median(coldRuns[bestCold])
			}
			if bestWarm != "" {
				hot.qemu = median(warmRuns[bestWarm])
			}
		}
		logRow(cold)
		logRow(hot)
		rows = append(rows, cold, hot)
	}
	return append(rows, benchHTTPTree(dir, url[:strings.LastIndex(url, "/")+1], www, exporters))
}

// benchHTTPTree is the loop-mount row of the http target: an ext4 image
// holding a tree of real files (the Go toolchain: about 270 MB in 15,000
// files) served by nginx, exported, loop-mounted read-only and read back
// whole (tar) with every cache dropped, loopReps times per exporter (the
// order rotating, the median counts). Ours runs with its defaults; the
// anchors are nbdkit's curl plugin behind nbdfuse; qemu-storage-daemon's
// curl node is left out (its FUSE export makes no progress with requests
// in flight, as in the rows above, and a loop device over a stalled
// export leaves tar in uninterruptible sleep). The file column is the
// loop device on the local image itself.
func benchHTTPTree(dir, base, www string, exporters []httpExporter) row {
	r := row{target: "http", name: "ext4 loop: read the tree back, cold (s)", unit: "s"}
	out, err := exec.Command("go", "env", "GOROOT").Output()
	if err != nil {
		log.Fatal(err)
	}
	src := strings.TrimSpace(string(out))
	img := filepath.Join(www, "tree.img")
	if err := httpTreeImage(img, src, dir); err != nil {
		log.Printf("http tree image: %v", err)
		return r
	}
	defer os.Remove(img)
	var sys []httpExporter
	for _, e := range exporters {
		if e.s.name != "qemu-storage-daemon" && e.only != "warm" {
			sys = append(sys, e)
		}
	}
	sys = append(sys, httpExporter{s: system{name: "file"}})
	samples := map[string][]float64{}
	for rep := range *loopReps {
		for _, e := range rotateHTTP(sys, rep) {
			file, mnt, cmds := img, filepath.Join(dir, "http.mnt"), []*exec.Cmd(nil)
			if e.start != nil {
				var err error
				if cmds, file, err = e.start(base+"tree.img", mnt); err != nil {
					log.Printf("%s: %v", e.s.key(), err)
					samples[e.s.key()] = append(samples[e.s.key()], 0)
					continue
				}
			}
			t, err := httpTreeRead(file, dir)
			if err != nil {
				log.Printf("%s: %v", e.s.key(), err)
				t = 0
			}
			samples[e.s.key()] = append(samples[e.s.key()], t)
			for k := len(cmds) - 1; k >= 0; k-- {
				stop(cmds[k], e.mount(mnt))
			}
		}
	}
	for _, e := range sys {
		v := median(samples[e.s.key()])
		log.Printf("  %-34s %s: %v -> median %.2f", r.name, e.s.key(), samples[e.s.key()], v)
		switch {
		case e.s.name == "file":
			r.file = v
		default:
			r.add(e.s, v)
		}
	}
	logRow(r)
	return r
}

// httpTreeImage makes img: a 1 GiB ext4 file system holding a copy of
// the tree src.
func httpTreeImage(img, src, dir string) error {
	if err := run("truncate", "-s", "1G", img); err != nil {
		return err
	}
	if err := run("mkfs.ext4", "-q", "-F", img); err != nil {
		return err
	}
	fs := filepath.Join(dir, "treefs")
	os.MkdirAll(fs, 0o755)
	if err := run("mount", "-o", "loop", img, fs); err != nil {
		return err
	}
	err := run("cp", "-a", src, filepath.Join(fs, "tree"))
	if uerr := run("umount", fs); err == nil {
		err = uerr
	}
	return err
}

// httpTreeRead loop-mounts file read-only, drops every cache and reads the
// tree back (tar into a pipe), returning the seconds that took.
func httpTreeRead(file, dir string) (float64, error) {
	out, err := exec.Command("losetup", "--find", "--show", "--read-only", file).Output()
	if err != nil {
		return 0, fmt.Errorf("losetup: %v", err)
	}
	dev := strings.TrimSpace(string(out))
	defer run("losetup", "-d", dev)
	fs := filepath.Join(dir, "treefs")
	os.MkdirAll(fs, 0o755)
	if err := run("mount", "-o", "ro,noload", dev, fs); err != nil {
		return 0, err
	}
	defer run("umount", fs)
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
		return 0, err
	}
	cmd := exec.Command("tar", "cf", "-", "-C", fs, ".")
	cmd.Stdout = io.Discard // a pipe: tar skips reading data it writes to /dev/null
	t0 := time.Now()
	err = cmd.Run()
	return time.Since(t0).Seconds(), err
}

// count adds e's cold and warm figures to the rows they count in.
func (e httpExporter) count(cold, hot *row, c, w float64) {
	if e.only != "warm" {
		cold.add(e.s, c)
	}
	if e.only != "cold" {
		hot.add(e.s, w)
	}
}

// rotateHTTP starts each row with another exporter (none always first).
func rotateHTTP(e []httpExporter, i int) []httpExporter {
	k := i % len(e)
	return append(append([]httpExporter(nil), e[k:]...), e[:k]...)
}

// httpFio runs one fio job (fioArgs: how much it reads); when it makes no progress within
// httpNoProgress the exporter's processes are killed (fio's requests then
// fail) and the run counts as failed.
func httpFio(job fioJob, file string, cmds []*exec.Cmd, mnt, what string, fioArgs ...string) float64 {
	type result struct {
		v   float64
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := fioRun(job, file, fioArgs...)
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			log.Printf("%s: %v", what, r.err)
			return 0
		}
		return r.v
	case <-time.After(*httpNoProgress):
		log.Printf("%s: no progress in %v: killed", what, *httpNoProgress)
		for _, c := range cmds {
			c.Process.Kill()
		}
		syscall.Unmount(mnt, syscall.MNT_DETACH)
		<-done
		return 0
	}
}

// httpBenchNginx serves www with nginx on a loopback port; it returns the
// image's URL and how to stop nginx.
func httpBenchNginx(dir, www string) (string, func()) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	ndir := filepath.Join(dir, "nginx")
	if err := os.MkdirAll(filepath.Join(ndir, "tmp"), 0o755); err != nil {
		log.Fatal(err)
	}
	conf := fmt.Sprintf(`daemon off;
master_process off;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
worker_processes 1;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path %[1]s/tmp; proxy_temp_path %[1]s/tmp; fastcgi_temp_path %[1]s/tmp; uwsgi_temp_path %[1]s/tmp; scgi_temp_path %[1]s/tmp;
  default_type application/octet-stream;
  keepalive_requests 1000000;
  sendfile on;
  server { listen %[2]s; root %[3]s; }
}
`, ndir, addr, www)
	confFile := filepath.Join(ndir, "nginx.conf")
	if err := os.WriteFile(confFile, []byte(conf), 0o644); err != nil {
		log.Fatal(err)
	}
	bin := "nginx"
	if _, err := exec.LookPath(bin); err != nil {
		bin = "/usr/sbin/nginx"
	}
	cmd := exec.Command(bin, "-c", confFile, "-p", ndir, "-e", filepath.Join(ndir, "error.log"))
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		log.Fatalf("the http rows serve the image with nginx (apt-get install -y nginx-light): %v", err)
	}
	for i := 0; ; i++ {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			break
		}
		if i == 500 {
			cmd.Process.Kill()
			cmd.Wait()
			log.Fatalf("nginx did not listen on %s", addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return "http://" + addr + "/disk.img", func() {
		cmd.Process.Kill()
		cmd.Wait()
		os.RemoveAll(ndir)
	}
}
