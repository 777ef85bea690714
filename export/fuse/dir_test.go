package fuse

import (
	"encoding/binary"
	"strings"
	"testing"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats/drivers/null"
)

// lookupIn is a LOOKUP request: the header, then the name and its NUL.
type lookupIn struct {
	fuse.InHeader
	name [16]byte
}

// TestDirectoryAroundTheFile drives the --file-name directory as the
// kernel does: LOOKUP of the one name and of others, GETATTR of both
// inodes, READDIR from each offset and into buffers too small for every
// entry, and the requests that would change the directory.
func TestDirectoryAroundTheFile(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	img, _ := null.New("null", 1<<20, true)
	exp := New(img, Options{Writable: true})
	exp.ino = fileIno
	s := newServer(exp, fds[0])
	s.fileName = "disk.img"
	k := kernelSide{t, fds[1]}
	serveFake(t, s, fds[0])
	defer unix.Close(fds[1]) // first: the loop reads end-of-file and stops
	unique := uint64(100)
	ask := func(send func(u uint64)) (fuse.OutHeader, []byte) {
		t.Helper()
		unique++
		send(unique)
		h, body, ok := k.replyBody(5000)
		if !ok || h.Unique != unique {
			t.Fatalf("no reply to request %d (got %+v)", unique, h)
		}
		return h, body
	}
	lookup := func(name string) (fuse.OutHeader, []byte) {
		return ask(func(u uint64) {
			in := lookupIn{InHeader: fuse.InHeader{Opcode: opLookup, Unique: u, NodeId: rootIno}}
			copy(in.name[:], name)
			b := unsafe.Slice((*byte)(unsafe.Pointer(&in)), inHeaderSize+len(name)+1)
			(*fuse.InHeader)(unsafe.Pointer(&b[0])).Length = uint32(len(b))
			unix.Write(k.fd, b)
		})
	}

	h, body := lookup("disk.img")
	if h.Status != 0 || len(body) < int(unsafe.Sizeof(fuse.EntryOut{})) {
		t.Fatalf("LOOKUP disk.img: status %d, %d bytes", h.Status, len(body))
	}
	e := (*fuse.EntryOut)(unsafe.Pointer(&body[0]))
	if e.NodeId != fileIno || e.Attr.Ino != fileIno || e.Attr.Size != 1<<20 || e.Attr.Mode&unix.S_IFMT != unix.S_IFREG {
		t.Fatalf("LOOKUP disk.img: %+v", e)
	}
	for _, name := range []string{"disk.im", "disk.img2", "other"} {
		if h, _ := lookup(name); h.Status != -int32(unix.ENOENT) {
			t.Errorf("LOOKUP %s: status %d, want -ENOENT", name, h.Status)
		}
	}

	for ino, mode := range map[uint64]uint32{rootIno: unix.S_IFDIR, fileIno: unix.S_IFREG} {
		h, body := ask(func(u uint64) {
			send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: ino}})
		})
		a := (*fuse.AttrOut)(unsafe.Pointer(&body[0]))
		if h.Status != 0 || a.Ino != ino || a.Mode&unix.S_IFMT != mode {
			t.Errorf("GETATTR %d: status %d, %+v", ino, h.Status, a.Attr)
		}
	}

	readdir := func(off uint64, size uint32) []string {
		t.Helper()
		h, body := ask(func(u uint64) {
			send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opReaddir, Unique: u, NodeId: rootIno}, Offset: off, Size: size})
		})
		if h.Status != 0 || len(body) > int(size) {
			t.Fatalf("READDIR off %d size %d: status %d, %d bytes", off, size, h.Status, len(body))
		}
		var names []string
		next := off
		for len(body) > 0 {
			if len(body) < 24 {
				t.Fatalf("READDIR off %d: %d bytes left, less than an entry", off, len(body))
			}
			d := dirent{ino: binary.NativeEndian.Uint64(body), off: binary.NativeEndian.Uint64(body[8:]),
				nameLen: binary.NativeEndian.Uint32(body[16:]), typ: binary.NativeEndian.Uint32(body[20:])}
			n := (24 + int(d.nameLen) + 7) &^ 7
			if d.off != next+1 || n > len(body) {
				t.Fatalf("READDIR off %d: entry %+v after offset %d, %d bytes left", off, d, next, len(body))
			}
			names = append(names, string(body[24:24+d.nameLen]))
			next = d.off
			body = body[n:]
		}
		return names
	}
	for _, c := range []struct {
		off  uint64
		size uint32
		want string
	}{
		{0, 4096, ". .. disk.img"},
		{1, 4096, ".. disk.img"},
		{2, 4096, "disk.img"},
		{3, 4096, ""},
		{0, 32, "."},        // one 32-byte entry fits, the next does not
		{0, 63, "."},        // "." and ".." take 64
		{2, 32, "disk.img"}, // 24 bytes of entry and 8 of name: exactly
		{2, 31, ""},         // one short
		{0, 0, ""},
	} {
		if joined := strings.Join(readdir(c.off, c.size), " "); joined != c.want {
			t.Errorf("READDIR off %d size %d lists %q, want %q", c.off, c.size, joined, c.want)
		}
	}

	for _, op := range []uint32{opMknod, opMkdir, opUnlink, opRmdir, opRename, opLink, opSymlink, opCreate, opRename2} {
		h, _ := ask(func(u uint64) {
			send(k, &fuse.InHeader{Opcode: op, Unique: u, NodeId: rootIno})
		})
		if h.Status != -int32(unix.EPERM) {
			t.Errorf("opcode %d in the directory: status %d, want -EPERM", op, h.Status)
		}
	}
	h, _ = ask(func(u uint64) {
		send(k, &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: fuse.InHeader{Opcode: opSetattr, Unique: u, NodeId: rootIno}, Valid: fuse.FATTR_MODE, Mode: 0o777}})
	})
	if h.Status != -int32(unix.EPERM) {
		t.Errorf("SETATTR of the directory: status %d, want -EPERM", h.Status)
	}
}

// TestCheckFileName: one path component, or a clear refusal.
func TestCheckFileName(t *testing.T) {
	for _, ok := range []string{"disk.img", "a b", "...", "x"} {
		if err := CheckFileName(ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for _, bad := range []string{"", ".", "..", "a/b", "/x", "a\x00b", string(make([]byte, 256))} {
		if err := CheckFileName(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// TestDirectoryWithExtraFiles: the partitions' files beside NAME, each
// its own inode answered by its own image: LOOKUP, GETATTR and READ of
// each reach the right size, READDIR lists them all, and extra files are
// refused without a directory or twice under one name.
func TestDirectoryWithExtraFiles(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	disk, _ := null.New("null", 1<<20, true)
	p1, _ := null.New("p1", 4096, true)
	p5, _ := null.New("p5", 8192, true)
	exp := New(disk, Options{Writable: true})
	exp.ino = fileIno
	s := newServer(exp, fds[0])
	if err := s.addExtraFiles([]ExtraFile{{"disk-p1", p1}}); err == nil {
		t.Error("extra files accepted without a directory")
	}
	s.fileName = "disk"
	for _, bad := range [][]ExtraFile{{{"disk", p1}}, {{"a", p1}, {"a", p5}}, {{"a/b", p1}}} {
		if err := s.addExtraFiles(bad); err == nil {
			t.Errorf("extra files %v accepted", bad)
		}
		s.extra = nil
	}
	if err := s.addExtraFiles([]ExtraFile{{"disk-p1", p1}, {"disk-p5", p5}}); err != nil {
		t.Fatal(err)
	}
	k := kernelSide{t, fds[1]}
	serveFake(t, s, fds[0])
	defer unix.Close(fds[1])
	unique := uint64(100)
	ask := func(send func(u uint64)) (fuse.OutHeader, []byte) {
		t.Helper()
		unique++
		send(unique)
		h, body, ok := k.replyBody(5000)
		if !ok || h.Unique != unique {
			t.Fatalf("no reply to request %d (got %+v)", unique, h)
		}
		return h, body
	}
	for _, c := range []struct {
		name string
		ino  uint64
		size uint64
	}{{"disk", fileIno, 1 << 20}, {"disk-p1", fileIno + 1, 4096}, {"disk-p5", fileIno + 2, 8192}} {
		h, body := ask(func(u uint64) {
			in := lookupIn{InHeader: fuse.InHeader{Opcode: opLookup, Unique: u, NodeId: rootIno}}
			copy(in.name[:], c.name)
			b := unsafe.Slice((*byte)(unsafe.Pointer(&in)), inHeaderSize+len(c.name)+1)
			(*fuse.InHeader)(unsafe.Pointer(&b[0])).Length = uint32(len(b))
			unix.Write(k.fd, b)
		})
		if h.Status != 0 {
			t.Fatalf("LOOKUP %s: status %d", c.name, h.Status)
		}
		e := (*fuse.EntryOut)(unsafe.Pointer(&body[0]))
		if e.NodeId != c.ino || e.Attr.Ino != c.ino || e.Attr.Size != c.size || e.Attr.Mode != unix.S_IFREG|0o600 {
			t.Errorf("LOOKUP %s: %+v", c.name, e)
		}
		h, body = ask(func(u uint64) {
			send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: c.ino}})
		})
		if a := (*fuse.AttrOut)(unsafe.Pointer(&body[0])); h.Status != 0 || a.Ino != c.ino || a.Size != c.size {
			t.Errorf("GETATTR %s: status %d, %+v", c.name, h.Status, a.Attr)
		}
		// A read across the file's end is cut there: its own size.
		h, body = ask(func(u uint64) {
			send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u, NodeId: c.ino}, Offset: c.size - 512, Size: 4096})
		})
		if h.Status != 0 || len(body) != 512 {
			t.Errorf("READ across the end of %s: status %d, %d bytes", c.name, h.Status, len(body))
		}
	}
	h, body := ask(func(u uint64) {
		send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opReaddir, Unique: u, NodeId: rootIno}, Offset: 2, Size: 4096})
	})
	var names []string
	for len(body) >= 24 {
		n := int(binary.NativeEndian.Uint32(body[16:]))
		names = append(names, string(body[24:24+n]))
		body = body[(24+n+7)&^7:]
	}
	if h.Status != 0 || strings.Join(names, " ") != "disk disk-p1 disk-p5" {
		t.Errorf("READDIR from 2: status %d, %q", h.Status, names)
	}
}
