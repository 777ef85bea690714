// Package nbd serves one image over the NBD protocol (fixed newstyle), as
// qemu-nbd and qemu-storage-daemon's NBD export do.
//
// The protocol's numbers are formats/protocols/nbd/wire's, shared with the NBD client
// (formats/protocols/nbd). What is written here, because go-nbd's server
// only speaks the baseline (serial READ/WRITE/DISC, a backend error drops
// the connection): NBD_OPT_EXPORT_NAME,
// STRUCTURED_REPLY, EXTENDED_HEADERS (32-byte headers with 64-bit lengths,
// and BLOCK_STATUS_EXT), LIST/SET_META_CONTEXT (base:allocation), the commands
// FLUSH, TRIM, WRITE_ZEROES (NO_HOLE, FAST_ZERO), BLOCK_STATUS, CACHE and
// FUA, structured replies, truthful transmission flags, and parallel
// processing: each request of a connection runs in its own goroutine and is
// answered when it completes, so replies may come out of order. Requests
// the image finishes without waiting (its TryReadAt and TryWriteAt: null,
// page-cache hits, qcow2 writes in place) are answered inline by the
// connection's reader, and a lone one runs there blocking; the FUSE server
// makes the same decision with the same helper (coroutines.Handoff). The
// reader serves its socket with plain syscalls rather than the netpoller
// (aio/sock). A client that goes away cancels its requests' context,
// which aio passes on to the ring. Reads send runs of zeroes as
// OFFSET_HOLE chunks.
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
