package qcow2

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"sync"

	"github.com/klauspost/compress/zstd"

	"github.com/blockexport/blockexport/formats/internal/inflate"
)

// Compressed clusters are decoded whole and kept in a small LRU, so that
// reading a compressed cluster in 4 KiB pieces inflates it once, not 16
// times.

// zstdDecoders reuses decoders: each holds sizeable window buffers.
var zstdDecoders = sync.Pool{New: func() any {
	// A cluster decodes to at most 2 MiB; refuse frames that ask for
	// more memory than that needs (a crafted image could ask for GiBs).
	d, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
		zstd.WithDecoderMaxWindow(8<<20), zstd.WithDecoderMaxMemory(16<<20))
	if err != nil {
		return err
	}
	return d
}}

// compressedCluster returns the decompressed cluster described by m.
func (q *Image) compressedCluster(ctx context.Context, m mapping) ([]byte, error) {
	if c, ok := q.dcache.Get(m.host); ok {
		return c, nil
	}
	comp := make([]byte, m.compSize)
	// Past the end of the file comp stays zeroes, as QEMU's block layer
	// pads a read there: a stream cut by a truncated file inflates on
	// through zero bits, and the cluster reads as in QEMU or fails as
	// in QEMU.
	n, err := q.f.ReadAt(ctx, comp, m.host)
	if err != nil && err != io.EOF {
		return nil, fmt.Errorf("qcow2: compressed cluster at %#x: %w", m.host, err)
	}
	clear(comp[n:])
	out := make([]byte, q.h.clusterSize)
	switch q.h.compressionType {
	case compressionZlib:
		// QEMU writes raw deflate (no zlib header) and reads a cluster
		// as inflate with Z_FINISH that fills the output: the stream may
		// go on past the cluster, but may not end before it.
		err = inflate.Fill(out, comp)
	case compressionZstd:
		var d *zstd.Decoder
		switch v := zstdDecoders.Get().(type) {
		case *zstd.Decoder:
			d = v
		case error:
			return nil, fmt.Errorf("qcow2: zstd decoder: %w", v)
		}
		if err = d.Reset(bytes.NewReader(comp)); err == nil {
			_, err = io.ReadFull(d, out)
		}
		zstdDecoders.Put(d)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: compressed cluster at %#x does not decompress: %v", ErrCorrupt, m.host, err)
	}
	q.dcache.Put(m.host, out)
	return out, nil
}
