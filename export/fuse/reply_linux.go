package fuse

// Replies: one writev per reply, header and payload gathered in place.

import (
	"runtime"
	"sync/atomic"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// replyTo is where a request's reply goes: the /dev/fuse fd it came
// from.
type replyTo struct {
	fd int
	// once, if set, is taken by whoever replies first: the request, or
	// the EINTR answered on its behalf when it outlives an INTERRUPT
	// (runStalling). The other's reply is dropped: after the first, the
	// kernel may have given the unique to a new request.
	once *atomic.Bool
}

// header views the request's header in place.
func header(req []byte) *fuse.InHeader { return (*fuse.InHeader)(unsafe.Pointer(&req[0])) }

// decode views the request's op struct (which embeds the InHeader) in
// place. A request shorter than the struct (an older kernel's layout) is
// copied into a zeroed one.
func decode[T any](req []byte) *T {
	var zero T
	if size := int(unsafe.Sizeof(zero)); len(req) < size {
		t := new(T)
		copy(unsafe.Slice((*byte)(unsafe.Pointer(t)), size), req)
		return t
	}
	return (*T)(unsafe.Pointer(&req[0]))
}

func (s *server) replyErr(to replyTo, unique uint64, errno unix.Errno) {
	s.reply(to, unique, -int32(errno))
}

// replyOut sends *v as the reply payload when st is OK. (Generic, not an
// interface, so the reply struct stays on the caller's stack.)
func replyOut[T any](s *server, to replyTo, unique uint64, st fuse.Status, v *T) {
	s.replyData(to, unique, st, unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v)))
}

// replyData answers with the bytes of bufs (none, or at most maxLent),
// in order, written from where they lie by one writev, when st is OK;
// else with st alone.
func (s *server) replyData(to replyTo, unique uint64, st fuse.Status, bufs ...[]byte) {
	if st != fuse.OK {
		s.replyErr(to, unique, unix.Errno(st))
		return
	}
	s.reply(to, unique, 0, bufs...)
}

// reply writes the header with errno, then bufs, with one writev.
func (s *server) reply(to replyTo, unique uint64, errno int32, bufs ...[]byte) {
	if to.once != nil && !to.once.CompareAndSwap(false, true) {
		return
	}
	var iov [1 + maxLent]unix.Iovec
	n, cnt := 0, 1
	for _, p := range bufs[:min(len(bufs), maxLent)] {
		if len(p) > 0 {
			iov[cnt] = unix.Iovec{Base: &p[0]}
			iov[cnt].SetLen(len(p))
			cnt++
			n += len(p)
		}
	}
	oh := fuse.OutHeader{Length: uint32(outHeaderSize + n), Status: errno, Unique: unique}
	iov[0] = unix.Iovec{Base: (*byte)(unsafe.Pointer(&oh))}
	iov[0].SetLen(outHeaderSize)
	s.writeReply(to.fd, unique, iov[:cnt])
	runtime.KeepAlive(bufs)
}

// writeReply writes one reply's vector to fd. A reply to a request the
// kernel has dropped meanwhile (ENOENT) is not an error.
func (s *server) writeReply(fd int, unique uint64, iov []unix.Iovec) {
	for {
		_, _, e := unix.Syscall(unix.SYS_WRITEV, uintptr(fd), uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
		switch e {
		case 0, unix.ENOENT, unix.ENODEV:
			return
		case unix.EINTR:
			continue
		}
		s.exp.log.Warn("writing a FUSE reply failed", "unique", unique, "err", e)
		return
	}
}
