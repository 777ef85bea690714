package fuse

// The directory around the file (--file-name NAME): the mount's root is
// then a directory holding the export as its entry NAME, as nbdfuse lays
// it out, and with --partitions the extra files (an Export each, on
// inodes 3, 4, ...). Without --file-name none of this runs: the kernel
// sends no directory requests for a regular file.

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
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
	// Extra files (partitions) are fileIno+1, fileIno+2, ...
)

// ExtraFile is one more file in the directory beside NAME: a partition,
// served from its own image (a byte range of the disk).
type ExtraFile struct {
	Name  string
	Image formats.Image
}

// extraFile is an extra file being served.
type extraFile struct {
	name string
	exp  *Export
}

// maxExtraFiles bounds the directory: one file per partition the kernel
// would number (DISK_MAX_PARTS).
const maxExtraFiles = 256

// addExtraFiles makes an export of each extra file, writable when the
// disk is, and with none of the disk's other options: a partition never
// grows, and no two inodes may cache the same bytes (each would go stale
// under the other's writes), so the disk's file must not be cached by the
// kernel either (the caller's rule: see --kernel-cache).
func (s *server) addExtraFiles(files []ExtraFile) error {
	if len(files) == 0 {
		return nil
	}
	if s.fileName == "" {
		return fmt.Errorf("extra files need a directory (--file-name)")
	}
	if len(files) > maxExtraFiles {
		return fmt.Errorf("%d extra files: at most %d", len(files), maxExtraFiles)
	}
	names := map[string]bool{s.fileName: true}
	for _, f := range files {
		if err := CheckFileName(f.Name); err != nil {
			return err
		}
		if names[f.Name] {
			return fmt.Errorf("two files named %q", f.Name)
		}
		names[f.Name] = true
		e := New(f.Image, Options{Writable: s.exp.opts.Writable, Logger: s.exp.opts.Logger})
		e.ino = fileIno + 1 + uint64(len(s.extra))
		s.extra = append(s.extra, extraFile{name: f.Name, exp: e})
	}
	return nil
}

// expOf is the export a request's inode names: an extra file's, or the
// disk's (the root file, the file NAME, and requests that name no file).
func (s *server) expOf(req []byte) *Export {
	if id := header(req).NodeId; id > fileIno && id-fileIno-1 < uint64(len(s.extra)) {
		return s.extra[id-fileIno-1].exp
	}
	return s.exp
}

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

// isRootDir says whether req is about the root directory.
func (s *server) isRootDir(req []byte) bool { return s.fileName != "" && header(req).NodeId == rootIno }

// dirAttr describes the root directory: read and search for all (file
// access is the file's own mode's business), nothing to write.
func (s *server) dirAttr(a *fuse.Attr) {
	s.exp.fillAttr(context.Background(), a) // the file's times and owner
	a.Ino, a.Size, a.Blocks, a.Mode, a.Nlink = rootIno, 4096, 0, unix.S_IFDIR|0o555, 2
}

// lookup finds NAME or an extra file in the root directory; every other
// name is absent.
func (s *server) lookup(q *queue, req []byte) bool {
	h := header(req)
	name, _, _ := bytes.Cut(req[inHeaderSize:], []byte{0})
	var e *Export // the names are unique (addExtraFiles)
	if s.isRootDir(req) && string(name) == s.fileName {
		e = s.exp
	}
	for _, f := range s.extra {
		if s.isRootDir(req) && string(name) == f.name {
			e = f.exp
		}
	}
	if e == nil {
		s.replyErr(q.to, h.Unique, unix.ENOENT)
		return true
	}
	out := fuse.EntryOut{NodeId: e.ino}
	out.SetEntryTimeout(attrTimeout)
	out.SetAttrTimeout(attrTimeout)
	e.fillAttr(context.Background(), &out.Attr)
	replyOut(s, q.to, h.Unique, fuse.OK, &out)
	return true
}

// opendir opens the root directory; it needs no handle.
func (s *server) opendir(q *queue, req []byte) bool {
	if !s.isRootDir(req) {
		s.replyErr(q.to, header(req).Unique, unix.ENOTDIR)
		return true
	}
	var o fuse.OpenOut
	replyOut(s, q.to, header(req).Unique, fuse.OK, &o)
	return true
}

// readdir lists ".", "..", NAME and the extra files from the entry the
// offset names, as many as fit; an entry's offset is the next one's index.
func (s *server) readdir(q *queue, req []byte) bool {
	in := decode[fuse.ReadIn](req)
	if !s.isRootDir(req) {
		s.replyErr(q.to, in.Unique, unix.ENOTDIR)
		return true
	}
	// "." and ".." have no export: the root directory.
	entries := append([]extraFile{{".", nil}, {"..", nil}, {s.fileName, s.exp}}, s.extra...)
	const direntSize = int(unsafe.Sizeof(dirent{}))
	out := q.out[:0]
	for i := in.Offset; i < uint64(len(entries)); i++ {
		e := entries[i]
		n := (direntSize + len(e.name) + 7) &^ 7 // each entry is padded to 8 bytes
		if len(out)+n > int(in.Size) || len(out)+n > cap(out) {
			break
		}
		d := dirent{ino: rootIno, off: i + 1, nameLen: uint32(len(e.name)), typ: unix.DT_DIR}
		if e.exp != nil {
			d.ino, d.typ = e.exp.ino, unix.DT_REG
		}
		start := len(out)
		out = append(out, unsafe.Slice((*byte)(unsafe.Pointer(&d)), direntSize)...)
		out = append(out, e.name...)
		out = append(out, make([]byte, start+n-len(out))...)
	}
	s.replyData(q.to, in.Unique, fuse.OK, out)
	return true
}
