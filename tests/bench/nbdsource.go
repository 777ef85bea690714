package main

import (
	"fmt"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// nbdSourceExporter is one way to present an NBD export as a file: ours,
// qemu-storage-daemon (an nbd blockdev under its FUSE export) or nbdfuse.
type nbdSourceExporter struct {
	s system
	// start mounts uri; it returns the process and the file fio uses.
	start func(uri, mnt string) (*exec.Cmd, string, error)
	// mount is what start mounted (a file, or nbdfuse's directory).
	mount func(mnt string) string
}

// benchNBDSource measures FUSE exports of an image on an NBD server: each
// exporter gets its own qemu-nbd --aio=io_uring serving its own
// page-cached 1 GiB raw image over a unix socket (so three processes
// share the cores: fio, the exporter, the server). The compared-with column quotes
// the faster of qemu-storage-daemon (with and without an iothread) and
// nbdfuse, named. qemu-nbd --shared=16 offers CAN_MULTI_CONN, so nbdfuse
// runs with one connection and with its default four (whichever is faster
// is quoted). Ours runs with its default, one (--connections 2 and 4
// measured no better here).
func benchNBDSource(dir, bin string) []row {
	log.Printf("target nbd source")
	exporters := []nbdSourceExporter{{
		s: system{name: "blockexport", ours: true},
		start: func(uri, mnt string) (*exec.Cmd, string, error) {
			cmd, err := startAndWait(exec.Command(bin, "fuse", "--log-level", "warn", "-w", "-f", "raw", uri, mnt), mnt)
			return cmd, mnt, err
		},
		mount: func(mnt string) string { return mnt },
	}}
	for _, iothread := range []bool{false, true} {
		c := qemuConfig{iothread: iothread}
		if !pinned(c) {
			continue
		}
		exporters = append(exporters, nbdSourceExporter{
			s: system{name: "qemu-storage-daemon", config: "nbd blockdev, " + c.String()},
			start: func(uri, mnt string) (*exec.Cmd, string, error) {
				sock := uri[len("nbd+unix:///src?socket="):]
				var args []string
				opts := ""
				if iothread {
					args, opts = append(args, "--object", "iothread,id=iot0"), ",iothread=iot0"
				}
				args = append(args, "--blockdev", "nbd,node-name=n,server.type=unix,server.path="+sock+",export=src",
					"--export", "fuse,id=e,node-name=n,mountpoint="+mnt+",writable=on"+opts)
				cmd, err := startAndWait(exec.Command("qemu-storage-daemon", args...), mnt)
				return cmd, mnt, err
			},
			mount: func(mnt string) string { return mnt },
		})
	}
	for _, conns := range []string{"1", "4"} {
		config := "-C " + conns
		if conns == "4" {
			config += ", its default"
		}
		exporters = append(exporters, nbdSourceExporter{
			s: system{name: "nbdfuse", config: config},
			start: func(uri, mnt string) (*exec.Cmd, string, error) {
				d := mnt + ".d"
				os.Mkdir(d, 0o755)
				cmd := exec.Command("nbdfuse", "-C", conns, d, uri)
				cmd.Stderr = os.Stderr
				if err := cmd.Start(); err != nil {
					return nil, "", err
				}
				for i := 0; i < 500 && !mounted(d); i++ {
					time.Sleep(20 * time.Millisecond)
				}
				if !mounted(d) {
					cmd.Process.Kill()
					cmd.Wait()
					return nil, "", fmt.Errorf("nbdfuse did not mount %s", d)
				}
				return cmd, filepath.Join(d, "nbd"), nil
			},
			mount: func(mnt string) string { return mnt + ".d" },
		})
	}

	type live struct {
		server, exporter *exec.Cmd
		image, file, mnt string
	}
	lives := map[string]live{}
	defer func() {
		for _, l := range lives {
			stop(l.exporter, l.mnt)
			l.server.Process.Signal(syscall.SIGTERM)
			l.server.Wait()
			os.Remove(l.image)
		}
	}()
	systems := make([]system, len(exporters))
	for i, e := range exporters {
		systems[i] = e.s
		image := filepath.Join(dir, fmt.Sprintf("nbdsrc-%d.img", i))
		if err := makeImage("raw", image); err != nil {
			log.Fatal(err)
		}
		sock := filepath.Join(dir, fmt.Sprintf("nbdsrc-%d.sock", i))
		server := exec.Command("qemu-nbd", "--aio=io_uring", "-f", "raw", "-x", "src", "--shared=16", "--persistent", "-k", sock, image)
		server.Stderr = os.Stderr
		if err := server.Start(); err != nil {
			log.Fatal(err)
		}
		for k := 0; k < 500; k++ {
			if c, err := net.Dial("unix", sock); err == nil {
				c.Close()
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		mnt := filepath.Join(dir, fmt.Sprintf("nbdsrc-%d.mnt", i))
		cmd, file, err := e.start("nbd+unix:///src?socket="+sock, mnt)
		if err != nil {
			server.Process.Kill()
			log.Fatal(err)
		}
		lives[e.s.key()] = live{server, cmd, image, file, e.mount(mnt)}
	}
	var rows []row
	for i, job := range matrix() {
		r := row{target: "nbd source", name: job.name, unit: "IOPS", higherBetter: true}
		if job.bs == "1M" {
			r.unit = "MiB/s"
		}
		for _, s := range rotate(systems, i) {
			l := lives[s.key()]
			warm(l.image)
			v, err := fio(job, l.file)
			if err != nil {
				log.Printf("%s: %v", s.key(), err)
			}
			r.add(s, v)
		}
		logRow(r)
		rows = append(rows, r)
	}
	return rows
}
