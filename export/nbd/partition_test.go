package nbd

import (
	"bufio"
	"bytes"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/filters/partition"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// TestPartitionExports: a disk's partitions as extra export names. LIST
// names them all; INFO describes one without choosing it; GO chooses it,
// and then reads and writes land in its range of the disk and never past
// it.
func TestPartitionExports(t *testing.T) {
	path := filepath.Join(t.TempDir(), "disk.raw")
	disk := bytes.Repeat([]byte{0xa5}, 1<<20)
	copy(disk[64<<10:], "p1 starts here")
	if err := os.WriteFile(path, disk, 0o600); err != nil {
		t.Fatal(err)
	}
	img := openRaw(t, path, true)
	p1, err := partition.NewRange(img, 64<<10, 128<<10, "disk-p1")
	if err != nil {
		t.Fatal(err)
	}
	p5, err := partition.NewRange(img, 512<<10, 4096, "disk-p5")
	if err != nil {
		t.Fatal(err)
	}
	s := New(img, Options{Name: "disk", Writable: true, Extra: []Export{{Name: "disk-p1", Description: "partition 1", Image: p1}, {Name: "disk-p5", Image: p5}}})
	a, b := net.Pipe()
	cn := newConn(s, pipeStream(t, a), s.log)
	s.wg.Add(1)
	go func() { defer s.wg.Done(); cn.serve() }()
	t.Cleanup(func() { b.Close(); s.wg.Wait() })
	b.SetDeadline(time.Now().Add(10 * time.Second))
	c := &client{t: t, c: b, r: bufio.NewReader(b)}
	c.greet()

	types, payloads := c.option(wire.OptList, nil)
	var names []string
	for i, p := range payloads {
		if types[i] == wire.RepServer {
			names = append(names, string(p[4:4+be.Uint32(p)]))
		}
	}
	if len(names) != 3 || names[0] != "disk" || names[1] != "disk-p1" || names[2] != "disk-p5" || types[len(types)-1] != wire.RepAck {
		t.Fatalf("LIST: %q", names)
	}
	sizeOf := func(id uint32, name string) uint64 {
		t.Helper()
		types, payloads := c.option(id, goData(name))
		for i, p := range payloads {
			if types[i] == wire.RepInfo && be.Uint16(p) == wire.InfoExport {
				return be.Uint64(p[2:])
			}
		}
		t.Fatalf("%d %s: %v", id, name, types)
		return 0
	}
	if n := sizeOf(wire.OptInfo, "disk-p5"); n != 4096 {
		t.Fatalf("INFO disk-p5: size %d", n)
	}
	if n := sizeOf(wire.OptGo, "disk-p1"); n != 128<<10 {
		t.Fatalf("GO disk-p1: size %d", n)
	}
	c.request(wire.CmdRead, 0, 1, 0, 14, nil)
	if _, code, data := c.simpleReply(14); code != 0 || string(data) != "p1 starts here" {
		t.Fatalf("read of p1: code %d %q", code, data)
	}
	c.request(wire.CmdWrite, 0, 2, 128<<10-4, 8, []byte("12345678"))
	if _, code, _ := c.simpleReply(0); code != wire.ENoSpc {
		t.Fatalf("write across the end of p1: code %d, want ENOSPC", code)
	}
	c.request(wire.CmdWrite, 0, 3, 128<<10-4, 4, []byte("1234"))
	if _, code, _ := c.simpleReply(0); code != 0 {
		t.Fatalf("write at the end of p1: code %d", code)
	}
	c.request(wire.CmdWriteZeroes, 0, 4, 0, 64<<10, nil)
	if _, code, _ := c.simpleReply(0); code != 0 {
		t.Fatalf("write-zeroes in p1: code %d", code)
	}
	c.request(wire.CmdFlush, 0, 5, 0, 0, nil)
	if _, code, _ := c.simpleReply(0); code != 0 {
		t.Fatalf("flush: code %d", code)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want := bytes.Clone(disk)
	clear(want[64<<10 : 128<<10])
	copy(want[192<<10-4:], "1234")
	if !bytes.Equal(got, want) {
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("the disk differs first at byte %d: %#x, want %#x", i, got[i], want[i])
			}
		}
	}
}
