package qcow2

import (
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
)

// FuzzDropBacking: a header whose extension area and backing name place
// and length are the fuzzer's (an extension at each length, one that
// overruns the name, a name inside the header fields, offsets near 2^63)
// either fails to open, or opens, copies on read and drops its backing
// file without a panic; an image that dropped it reopens with none and
// with its other extensions.
func FuzzDropBacking(f *testing.F) {
	f.Add([]byte{}, uint64(0), uint32(0))
	f.Add([]byte{0xe2, 0x79, 0x2a, 0xca, 0, 0, 0, 3, 'r', 'a', 'w', 0, 0, 0, 0, 0}, uint64(0), uint32(0))
	f.Add([]byte{0x68, 0x03, 0xf8, 0x57, 0, 0, 0, 48}, uint64(0), uint32(0))
	f.Add([]byte{0xe2, 0x79, 0x2a, 0xca, 0xff, 0xff, 0xff, 0xff}, uint64(1<<63-1), uint32(1<<31))
	f.Add([]byte{0, 0, 0, 0}, uint64(72), uint32(4))
	f.Add([]byte{0, 0, 0, 0}, uint64(1<<63), uint32(1023))
	f.Add([]byte{0xe2, 0x79, 0x2a, 0xca, 0, 0, 0, 0}, uint64(112), uint32(8))
	dir := f.TempDir()
	tmpl := filepath.Join(dir, "tmpl.qcow2")
	if err := Create(tmpl, CreateOptions{Size: 4 << 20, ClusterSize: 65536, BackingFile: "base.raw", BackingFormat: "raw"}); err != nil {
		f.Fatal(err)
	}
	orig, err := os.ReadFile(tmpl)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, ext []byte, nameOff uint64, nameLen uint32) {
		img := bytesCopy(orig)
		hlen := int(binary.BigEndian.Uint32(img[hdrHeaderLength:]))
		if len(ext) > 4096-hlen {
			ext = ext[:4096-hlen]
		}
		copy(img[hlen:], ext)
		if nameOff != 0 || nameLen != 0 {
			binary.BigEndian.PutUint64(img[hdrBackingOffset:], nameOff)
			binary.BigEndian.PutUint32(img[hdrBackingSize:], nameLen)
		}
		path := filepath.Join(t.TempDir(), "f.qcow2")
		if err := os.WriteFile(path, img, 0o644); err != nil {
			t.Fatal(err)
		}
		open := func(p string) (*Image, error) {
			af, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
			if err != nil {
				return nil, err
			}
			return New(context.Background(), af, Options{Writable: true, OpenBacking: func(string, string) (formats.Image, error) {
				return null.New("base", 1<<20, true)
			}})
		}
		q, err := open(path)
		if err != nil {
			return // refused at open: DropBacking never sees it
		}
		ctx := context.Background()
		buf := make([]byte, 70000)
		if _, err := q.ReadCopy(ctx, buf, 12345); err != nil {
			q.Close()
			return
		}
		hadExt := q.h.featureNames != nil
		hadBacking := q.h.backingFile != ""
		err = q.DropBacking(ctx)
		q.Close()
		if err != nil {
			return
		}
		q2, err := open(path)
		if err != nil {
			t.Fatalf("the image does not reopen after DropBacking: %v", err)
		}
		defer q2.Close()
		if hadBacking && (q2.h.backingFile != "" || q2.h.backingFormat != "" || q2.backing != nil) {
			t.Fatalf("reopened with a backing file %q (%q)", q2.h.backingFile, q2.h.backingFormat)
		}
		if hadExt && q2.h.featureNames == nil {
			t.Fatal("DropBacking lost the feature names extension")
		}
	})
}

func bytesCopy(b []byte) []byte { return append([]byte(nil), b...) }
