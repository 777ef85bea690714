package fuse

// The directory around the file (--file-name NAME): the mount's root is
// then a directory holding the export as its one entry, NAME, as nbdfuse
// lays it out. Nothing else can be made or removed there. Without
// --file-name the root is the file itself (QEMU's layout) and none of
// this runs: the kernel sends no directory requests for a regular file.

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// dirent is struct fuse_dirent (include/uapi/linux/fuse.h), the fixed
// part of a READDIR entry; the name follows, padded to 8 bytes. (go-fuse
// does not export its own.)
type dirent struct {
	ino     uint64
	off     uint64
	nameLen uint32
	typ     uint32
}

const (
	rootIno = 1 // the mount's root: the file, or the directory around it
	fileIno = 2 // the file inside the directory
)

// CheckFileName checks a --file-name: one path component.
func CheckFileName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("--file-name: empty name")
	case name == "." || name == "..":
		return fmt.Errorf("--file-name %q: want a file name, not a directory reference", name)
	case strings.ContainsAny(name, "/\x00"):
		return fmt.Errorf("--file-name %q: want one file name, without '/'", name)
	case len(name) > 255:
		return fmt.Errorf("--file-name: the name is %d bytes; at most 255", len(name))
	}
	return nil
}

// inDir says whether the export is a file inside the root directory.
func (s *server) inDir() bool { return s.fileName != "" }

// isRootDir says whether req is about the root directory.
func (s *server) isRootDir(req []byte) bool { return s.inDir() && header(req).NodeId == rootIno }

// dirAttr describes the root directory: read and search for all (file
// access is the file's own mode's business), nothing to write.
func (s *server) dirAttr(a *fuse.Attr) {
	e := s.exp
	sec, nsec := uint64(e.mtime.Unix()), uint32(e.mtime.Nanosecond())
	*a = fuse.Attr{
		Ino:   rootIno,
		Size:  4096,
		Atime: sec, Mtime: sec, Ctime: sec,
		Atimensec: nsec, Mtimensec: nsec, Ctimensec: nsec,
		Mode:    unix.S_IFDIR | 0o555,
		Nlink:   2,
		Owner:   fuse.Owner{Uid: e.uid.Load(), Gid: e.gid.Load()},
		Blksize: 4096,
	}
}

// lookup finds NAME in the root directory; every other name is absent.
func (s *server) lookup(q *queue, req []byte) inlineResult {
	h := header(req)
	name, _, _ := bytes.Cut(req[inHeaderSize:], []byte{0})
	if !s.inDir() || h.NodeId != rootIno || string(name) != s.fileName {
		s.replyErr(q.to, h.Unique, unix.ENOENT)
		return answered
	}
	out := fuse.EntryOut{NodeId: fileIno}
	out.SetEntryTimeout(attrTimeout)
	out.SetAttrTimeout(attrTimeout)
	s.exp.fillAttr(context.Background(), &out.Attr)
	replyOut(s, q.to, h.Unique, fuse.OK, &out)
	return answered
}

// opendir opens the root directory; it needs no handle.
func (s *server) opendir(q *queue, req []byte) inlineResult {
	if !s.isRootDir(req) {
		s.replyErr(q.to, header(req).Unique, unix.ENOTDIR)
		return answered
	}
	var o fuse.OpenOut
	replyOut(s, q.to, header(req).Unique, fuse.OK, &o)
	return answered
}

// readdir lists ".", ".." and NAME from the entry the offset names,
// as many as fit in the size asked for. An entry's offset is the index
// of the entry after it.
func (s *server) readdir(q *queue, req []byte) inlineResult {
	in := decode[fuse.ReadIn](req)
	if !s.isRootDir(req) {
		s.replyErr(q.to, in.Unique, unix.ENOTDIR)
		return answered
	}
	entries := [...]struct {
		ino  uint64
		typ  uint32
		name string
	}{{rootIno, unix.DT_DIR, "."}, {rootIno, unix.DT_DIR, ".."}, {fileIno, unix.DT_REG, s.fileName}}
	const direntSize = int(unsafe.Sizeof(dirent{}))
	out := q.out[:0]
	for i := in.Offset; i < uint64(len(entries)); i++ {
		e := entries[i]
		n := (direntSize + len(e.name) + 7) &^ 7 // each entry is padded to 8 bytes
		if len(out)+n > int(in.Size) || len(out)+n > cap(out) {
			break
		}
		d := dirent{ino: e.ino, off: i + 1, nameLen: uint32(len(e.name)), typ: e.typ}
		start := len(out)
		out = append(out, unsafe.Slice((*byte)(unsafe.Pointer(&d)), direntSize)...)
		out = append(out, e.name...)
		out = append(out, make([]byte, start+n-len(out))...)
	}
	s.replyData(q.to, in.Unique, fuse.OK, out)
	return answered
}
