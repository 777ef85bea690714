// Package nbd serves one image over the NBD protocol (fixed newstyle), as
// qemu-nbd and qemu-storage-daemon's NBD export do. go-nbd's server speaks
// only the baseline (serial READ/WRITE/DISC; a backend error drops the
// connection), so the rest is here, with the numbers of
// formats/protocols/nbd/wire: structured replies and extended headers,
// meta contexts, every command and flag, and parallel processing: each
// request runs in its own goroutine and is answered when it completes, out
// of order. Requests the image finishes without waiting are answered inline
// by the connection's reader, and a lone one runs there blocking, as the
// FUSE server decides (coroutines.Handoff). The reader uses plain syscalls
// rather than the netpoller (aio/sock). A client that goes away cancels
// its requests' context, which aio passes on to the ring.
package nbd

// What this server advertises and accepts.
const (
	baseAllocID = uint32(1)
	// Block size constraints we advertise: any byte alignment works, 4 KiB
	// is best, and 32 MiB is the largest request.
	minBlock       = 1
	preferredBlock = 4096
	maxRequest     = 32 << 20
	// maxOptionLen bounds an option's payload (names are at most 4 KiB).
	maxOptionLen = 64 << 10
)
