//go:build !amd64

package inflate

import (
	"encoding/binary"
	"hash/adler32"
)

// Adler32Update is the Adler-32 of the bytes whose checksum is adler
// (1 for none) followed by p.
func Adler32Update(adler uint32, p []byte) uint32 {
	h := adler32.New()
	// The digest's state is its checksum: restore it, then add p.
	state := append([]byte("adl\x01"), binary.BigEndian.AppendUint32(nil, adler)...)
	h.(interface{ UnmarshalBinary([]byte) error }).UnmarshalBinary(state)
	h.Write(p)
	return h.Sum32()
}
