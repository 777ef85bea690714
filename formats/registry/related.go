package registry

// Files an image names: a VMDK descriptor's extents and parentFileNameHint,
// a VHD or VHDX parent locator. The image is untrusted, so what it names
// is too: QEMU 7.2 opens whatever path an extent gives (../../etc/passwd,
// /dev/zero, a FIFO it then hangs on, the image itself), so an export run
// as root serves any file of the host to whoever reads the export. Every
// such name goes through the two functions here, and nowhere else:
//
//   - openRelated opens a file the image reads as bytes (an extent);
//   - openRelatedImage opens an image the image stacks on (a parent).
//
// Both resolve name as QEMU does (relative to the directory of the image
// as it was named; an absolute name as it is), then resolve every symlink
// and refuse the result unless it lies inside that directory or one of
// Options.RelatedDirs. Only regular files are opened: device nodes, FIFOs,
// sockets and directories are refused before any open, and the open
// itself is non-blocking and checked again by fstat (a file swapped for a
// FIFO in between is still refused, never waited on). A file that is
// already part of the chain (the image itself, an extent opened before, a
// parent), by device and inode, is refused as a loop.

import (
	"cmp"
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/raw"
)

// ErrRelatedRefused marks a file an image names that is not opened: it
// lies outside the allowed directories, is no regular file, or is part of
// the chain already.
var ErrRelatedRefused = errors.New("refused")

// maxRelatedFiles bounds the files one chain opens by name (extents): each
// holds a descriptor, and a descriptor of a million extents would exhaust
// them.
const maxRelatedFiles = 4096

// relatedPath resolves name, as the image at image names it, to the real
// path to open. shown is the path as QEMU names it (image's directory
// joined with a relative name), for messages and info.
func (c *chain) relatedPath(image, name string) (real, shown string, err error) {
	if name == "" || strings.IndexByte(name, 0) >= 0 {
		return "", "", fmt.Errorf("%s names a file %q: %w (empty or not a path)", image, name, ErrRelatedRefused)
	}
	if strings.Contains(image, "://") {
		// A remote image (http://…): the files it names are not looked
		// for, on the server or here (a local file is not for a server's
		// image to name: an export would show it).
		return "", name, fmt.Errorf("%s is remote and names the file %s: %w (extents and parents of remote images are not opened)", image, Shown(name), ErrRelatedRefused)
	}
	dir := filepath.Dir(image)
	shown = qemuPath(image, name)
	allowed := make([]string, 0, 1+len(c.o.RelatedDirs))
	for _, d := range append([]string{dir}, c.o.RelatedDirs...) {
		rd, err := filepath.EvalSymlinks(d)
		if err != nil {
			continue // a directory that is not there allows nothing
		}
		if rd, err = filepath.Abs(rd); err == nil {
			allowed = append(allowed, rd)
		}
	}
	real, err = filepath.EvalSymlinks(shown)
	if err != nil {
		return "", shown, fmt.Errorf("%s: file %s it names: %w", image, shown, err)
	}
	if real, err = filepath.Abs(real); err != nil {
		return "", shown, fmt.Errorf("%s: file %s it names: %w", image, shown, err)
	}
	inside := false
	for _, d := range allowed {
		if rel, err := filepath.Rel(d, real); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
			inside = true
			break
		}
	}
	if !inside {
		return "", shown, fmt.Errorf("%s names %s, which is %s, outside the image's directory: %w (files an image names stay in its directory; allow another with --allow-dir DIR)", image, name, real, ErrRelatedRefused)
	}
	var st unix.Stat_t
	if err := unix.Lstat(real, &st); err != nil {
		return "", shown, fmt.Errorf("%s: file %s it names: %w", image, shown, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return "", shown, fmt.Errorf("%s names %s, a %s: %w (only regular files)", image, shown, aio.FileType(st.Mode), ErrRelatedRefused)
	}
	if prev, ok := c.seen[[2]uint64{st.Dev, st.Ino}]; ok {
		return "", shown, fmt.Errorf("%s names %s, which is %s again: %w (a loop)", image, shown, prev, ErrRelatedRefused)
	}
	return real, shown, nil
}

// openRelated opens the file name that the image at path image names, to
// be read as part of it (a VMDK extent): read-only, with the locks a
// backing file takes (nobody may write it while we read it), or, for an
// image opened writable, writable with the locks of a writable image;
// O_DIRECT behind aio.Aligned under --cache none. It returns the file and
// its name as QEMU shows it (info's extent file names, map's file).
func (c *chain) openRelated(image, name string, writable bool) (aio.File, string, error) {
	real, shown, err := c.relatedPath(image, name)
	if err != nil {
		return nil, shown, err
	}
	if c.related++; c.related > maxRelatedFiles {
		return nil, shown, fmt.Errorf("%s: more than %d files named: %w", image, maxRelatedFiles, ErrRelatedRefused)
	}
	lock := c.o.lock(raw.Lock, writable, !writable)
	f, err := aio.Open(real, aio.Options{Backend: c.o.Backend, Writable: writable, Direct: c.o.Direct, Logger: c.o.Logger, Lock: lock})
	if err != nil {
		return nil, shown, fmt.Errorf("%s: file %s it names: %w", image, shown, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(f.Fd(), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		f.Close()
		return nil, shown, fmt.Errorf("%s names %s, which is no longer a regular file: %w", image, shown, ErrRelatedRefused)
	}
	id := [2]uint64{st.Dev, st.Ino}
	if prev, ok := c.seen[id]; ok {
		f.Close()
		return nil, shown, fmt.Errorf("%s names %s, which is %s again: %w (a loop)", image, shown, prev, ErrRelatedRefused)
	}
	c.seen[id] = shown
	c.hosts = append(c.hosts, f)
	if c.o.Direct {
		f = aio.Aligned(f, aio.LogicalBlockSize(f.Fd()))
	}
	return f, shown, nil
}

// openRelatedImage opens the image name that the image at path image
// stacks on (a VMDK parent, a VHD/VHDX parent locator), in format ("":
// detected), read-only through the chain (loops and depth bounded as for
// backing files), confined as openRelated confines. With NoBacking it
// opens nothing and returns a nil image.
func (c *chain) openRelatedImage(image, name, format string) (formats.Image, string, error) {
	if c.o.NoBacking {
		// Nothing is opened, so nothing needs confining; the name is
		// still shown as the image gives it.
		return nil, qemuPath(image, name), nil
	}
	// The checks are on the resolved path; the open is by the name QEMU
	// shows (info names the parent so, and its own extents are relative
	// to it), which resolves to that path.
	_, shown, err := c.relatedPath(image, name)
	if err != nil {
		return nil, shown, err
	}
	img, _, err := c.open(shown, cmp.Or(format, Auto), false, true)
	return img, shown, err
}

// qemuPath is name as QEMU forms it from the image's path: a relative
// name after the image's directory as given ("dir/" + name, unresolved:
// "dir/../x" stays so), an absolute one as it is.
func qemuPath(image, name string) string {
	if filepath.IsAbs(name) {
		return name
	}
	i := strings.LastIndexByte(image, '/')
	if i < 0 {
		return name
	}
	return image[:i+1] + name
}
