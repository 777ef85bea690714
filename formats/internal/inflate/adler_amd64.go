package inflate

// adlerChunks is in adler_amd64.s.
//
//go:noescape
func adlerChunks(p []byte) (sum, psum, wsum uint64)

// Adler32Update is the Adler-32 (RFC 1950) of the bytes whose checksum
// is adler (1 for none) followed by p, 16 bytes a step with SSE2:
// the standard library's adds byte by byte, each add waiting on the one
// before (3 GB/s here), and was a third of the CPU of random reads of a
// stream-optimized disk, whose grains' checksums are checked as each is
// first read.
func Adler32Update(adler uint32, p []byte) uint32 {
	const mod = 65521
	s1, s2 := uint64(adler&0xffff), uint64(adler>>16)
	for len(p) >= 16 {
		n := min(len(p), 64<<10) &^ 15
		sum, psum, wsum := adlerChunks(p[:n])
		// A byte at chunk c, place i of k chunks adds 16(k-c-1) + (16-i)
		// to s2: psum counts each chunk's sum once per chunk after it.
		s2 = (s2 + uint64(n)*s1 + 16*psum + wsum) % mod
		s1 = (s1 + sum) % mod
		p = p[n:]
	}
	for _, c := range p {
		s1 += uint64(c)
		s2 += s1
	}
	return uint32(s2%mod)<<16 | uint32(s1%mod)
}
