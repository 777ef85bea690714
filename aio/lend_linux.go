package aio

import (
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// PageSource is a File that can lend a range of its bytes where they lie
// in the page cache (a slice of a read-only shared mapping of the file),
// for a front end that writes its reply straight from there: one writev,
// where a read costs a pread and a writev. Residency is known per page,
// learned by mincore a 2 MiB chunk at a time and trusted for a while
// (pageMap; docs/design.md, Mapped reads): a check per read would be a
// system call again.
type PageSource interface {
	// TryLend returns [off, off+n) if every page of it was in the page cache
	// a moment ago (see residencyTTL), readable until the file is closed and
	// only ever given to the kernel (a writev), never read in Go: an evicted
	// page is read back in by the writev's fault, one cut off by a truncate
	// fails it with EFAULT. false: read it instead. Callers keep to the file's
	// size (the rest of its last page is lent too, as zeroes).
	TryLend(off, n int64) ([]byte, bool)
	// Zeroes returns n zero bytes (n at most LendZeroes) that stay
	// readable until the file is closed, for the holes of a lent read.
	Zeroes(n int) ([]byte, bool)
}

const (
	// lendChunk is what one mincore learns: 512 pages, 2 MiB (one page
	// table's worth).
	lendChunk = 2 << 20
	// lendMapMax bounds the mapping (address space only) and with it the page
	// tables a long random reader leaves: 8 bytes a page touched, 2 MiB a GiB.
	lendMapMax = 64 << 30
	// residencyTTL is how long a page seen resident is trusted: one that
	// is evicted meanwhile costs the loop that lends it one wait for the
	// disk (the writev's fault), as a read in the loop would.
	residencyTTL = time.Second
	// recheckAfter spaces the checks of a chunk that had pages missing:
	// a cold reader's requests go to the device anyway, and their pages
	// come in behind them.
	recheckAfter = 5 * time.Millisecond
	// LendZeroes is the most Zeroes lends at once.
	LendZeroes = 1 << 20
	// zapAfter is how long after the last lend the mapping's page-table
	// entries are dropped (MADV_DONTNEED): drop_caches and FADV_DONTNEED leave
	// a mapped page alone, so a reader gone this long leaves nothing mapped.
	// Not while lends go on: each page lent after a zap faults again, which
	// under random reads lost all the gain.
	zapAfter = 100 * time.Millisecond
)

// pageMap is a file's lending state: its mapping (made on the first
// TryLend), and what each chunk's last mincore said.
type pageMap struct {
	once     sync.Once
	mem      []byte // nil: the file cannot be mapped
	zeroes   []byte // LendZeroes of a private anonymous read-only mapping
	chunks   []atomic.Pointer[chunkRes]
	closed   atomic.Bool
	zapping  atomic.Bool  // a zap is due (zapAfter)
	lastLend atomic.Int64 // UnixNano
}

// chunkRes is one chunk's residency: a bit per page, and when it was
// learned (UnixNano).
type chunkRes struct {
	at   int64
	bits [lendChunk / 4096 / 64]uint64
}

func (m *pageMap) init(fd int) {
	m.once.Do(func() {
		var st unix.Stat_t
		if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			return // regular files only: a block device's size is not its file size, and nothing here was measured on one
		}
		// The whole cap, not the file's size: a growing image's new
		// blocks lie past the size at open. Pages past the end are never
		// resident, so never lent.
		mem, err := unix.Mmap(fd, 0, lendMapMax, unix.PROT_READ, unix.MAP_SHARED|unix.MAP_NORESERVE)
		if err != nil {
			return
		}
		z, err := unix.Mmap(-1, 0, LendZeroes, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			unix.Munmap(mem)
			return
		}
		m.mem, m.zeroes = mem, z
		m.chunks = make([]atomic.Pointer[chunkRes], lendMapMax/lendChunk)
	})
}

// lend is TryLend for a file whose fd is fd.
func (m *pageMap) lend(fd int, off, n int64) ([]byte, bool) {
	if n <= 0 || off < 0 || off > lendMapMax-n || m.closed.Load() {
		return nil, false
	}
	m.init(fd)
	if m.mem == nil {
		return nil, false
	}
	now := time.Now().UnixNano()
	if now-m.lastLend.Load() > int64(time.Millisecond) {
		m.lastLend.Store(now) // to the ms: one cache line, shared by the queues
	}
	if !m.zapping.Load() && m.zapping.CompareAndSwap(false, true) {
		time.AfterFunc(zapAfter, m.zapIdle)
	}
	for p := off &^ 4095; p < off+n; {
		c := p / lendChunk
		end := min(off+n, (c+1)*lendChunk)
		if !m.resident(c, p, end, now) {
			return nil, false
		}
		p = end
	}
	return m.mem[off : off+n : off+n], true
}

// resident says whether the pages of [from, end) in chunk c are known
// resident, learning the chunk again when what is known is stale, or
// says some are missing and is old enough to look again.
func (m *pageMap) resident(c, from, end, now int64) bool {
	r := m.chunks[c].Load()
	if r != nil && now-r.at < int64(residencyTTL) && r.has(from-c*lendChunk, end-c*lendChunk) {
		return true
	}
	if r != nil && now-r.at < int64(recheckAfter) {
		return false
	}
	r = m.learn(c, now)
	if r == nil {
		return false
	}
	m.chunks[c].Store(r)
	return r.has(from-c*lendChunk, end-c*lendChunk)
}

// learn asks the kernel which pages of chunk c are in the page cache.
func (m *pageMap) learn(c, now int64) *chunkRes {
	var vec [lendChunk / 4096]byte
	if mincore(m.mem[c*lendChunk:(c+1)*lendChunk], vec[:]) != nil {
		return nil
	}
	r := &chunkRes{at: now}
	for i, v := range vec {
		if v&1 != 0 {
			r.bits[i/64] |= 1 << (i % 64)
		}
	}
	return r
}

// mincore is mincore(2) of mapping b (page-aligned, non-empty): a byte
// per page in vec, bit 0 set where the page is in the page cache. It
// reads nothing in.
func mincore(b, vec []byte) error {
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		return errno
	}
	return nil
}

// has says whether every page of [from, end) (offsets in the chunk) is
// marked resident.
func (r *chunkRes) has(from, end int64) bool {
	for p := from / 4096; p < (end+4095)/4096; p++ {
		if r.bits[p/64]&(1<<(p%64)) == 0 {
			return false
		}
	}
	return true
}

// zapIdle zaps the mapping once no lend came for zapAfter, and until
// then waits on.
func (m *pageMap) zapIdle() {
	if idle := time.Duration(time.Now().UnixNano() - m.lastLend.Load()); idle < zapAfter {
		time.AfterFunc(zapAfter-idle, m.zapIdle)
		return
	}
	m.zapping.Store(false) // before: a lend after the zap schedules the next
	m.zap()
}

// zap drops the mapping's page-table entries (see zapAfter); after
// close, the inaccessible mapping's, which are none.
func (m *pageMap) zap() {
	if m.mem != nil {
		unix.Madvise(m.mem, unix.MADV_DONTNEED)
	}
}

// zero is Zeroes.
func (m *pageMap) zero(fd, n int) ([]byte, bool) {
	if n < 0 || n > LendZeroes || m.closed.Load() {
		return nil, false
	}
	m.init(fd)
	if m.zeroes == nil {
		return nil, false
	}
	return m.zeroes[:n:n], true
}

// close ends lending. The mappings are replaced by inaccessible anonymous
// ones, not unmapped: a lent slice still in a writev then fails it with
// EFAULT, where unmapped addresses could be the Go heap's again.
func (m *pageMap) close() {
	m.closed.Store(true)
	m.once.Do(func() {}) // no mapping from here on
	for _, b := range [][]byte{m.mem, m.zeroes} {
		if b != nil {
			unix.Syscall6(unix.SYS_MMAP, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), unix.PROT_NONE,
				unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED|unix.MAP_NORESERVE, ^uintptr(0), 0)
		}
	}
}

// TryLend: see PageSource. Never for O_DIRECT (no page cache). Under
// drop-behind too, though a lent page stays cached (a lend is no read
// that drop-behind counts, and FADV_DONTNEED leaves mapped pages): a
// caller that wants one cache does not lend (fuse's Export.lendPages).
func (h *hostFile) TryLend(off, n int64) ([]byte, bool) {
	if h.direct || h.closed() {
		return nil, false
	}
	return h.lend.lend(h.fd, off, n)
}

// Zeroes: see PageSource.
func (h *hostFile) Zeroes(n int) ([]byte, bool) { return h.lend.zero(h.fd, n) }

var (
	_ PageSource = (*uringFile)(nil)
	_ PageSource = (*threadFile)(nil)
)
