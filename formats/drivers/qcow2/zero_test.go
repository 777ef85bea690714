package qcow2

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// clusterState is one way a cluster can be mapped before it is zeroed.
type clusterState int

const (
	stUnallocated clusterState = iota // nothing here (nor in the backing file)
	stZero                            // v3 zero flag, no host cluster
	stZeroAlloc                       // zero flag on a kept host cluster
	stData                            // a data cluster this image owns
	stCompressed                      // a compressed cluster
	stShared                          // data shared with an internal snapshot
	stBackingOnly                     // unallocated here, data in the backing file
	numStates
)

func (s clusterState) String() string {
	return [...]string{"unallocated", "zero", "zero-alloc", "data", "compressed", "shared", "backing"}[s]
}

// TestZeroingAcrossClusterBoundaries zeroes and discards ranges that
// straddle a cluster boundary, in every alignment, between clusters in
// every pair of states, and checks the whole image against a shadow copy
// through QEMU. A range is looked at cluster by cluster: one side already
// reading as zeroes says nothing about the other (found: only the first
// cluster was looked at, and the second kept its data).
func TestZeroingAcrossClusterBoundaries(t *testing.T) {
	const cs = 4096
	// How far the range reaches into the cluster before the boundary and
	// the one after it; cs covers that cluster whole.
	reaches := []int64{1, 1000, cs - 1, cs}
	type pair struct {
		a, b   clusterState
		d1, d2 int64
	}
	var pairs []pair
	for a := range numStates {
		for b := range numStates {
			for _, d1 := range reaches {
				for _, d2 := range reaches {
					pairs = append(pairs, pair{a, b, d1, d2})
				}
			}
		}
	}
	size := int64(len(pairs)) * 2 * cs
	for _, withBacking := range []bool{false, true} {
		dir := t.TempDir()
		img := filepath.Join(dir, "z.qcow2")
		shadow := make([]byte, size)
		backing := make([]byte, size)
		var create []string
		if withBacking {
			bpath := filepath.Join(dir, "base.raw")
			for i, p := range pairs {
				for j, s := range []clusterState{p.a, p.b} {
					if s == stBackingOnly {
						c := int64(2*i+j) * cs
						copy(backing[c:c+cs], bytes.Repeat([]byte{0xb0 + byte(j)}, cs))
					}
				}
			}
			if err := os.WriteFile(bpath, backing, 0o644); err != nil {
				t.Fatal(err)
			}
			create = []string{"-b", bpath, "-F", "raw"}
		}
		tool(t, "qemu-img", append(append([]string{"create", "-q", "-f", "qcow2", "-o", "cluster_size=" + strconv.Itoa(cs)}, create...), img, strconv.FormatInt(size, 10))...)
		// Shared clusters first, then the snapshot, then the rest: their
		// L2 tables are shared too, and come unshared on first write.
		var before, after []string
		for i, p := range pairs {
			for j, s := range []clusterState{p.a, p.b} {
				c := int64(2*i+j) * cs
				pat := 0x10*int(s) + j + 1
				at := fmt.Sprintf("%d %d", c, cs)
				switch s {
				case stShared:
					before = append(before, fmt.Sprintf("write -P %d %s", pat, at))
				case stData:
					after = append(after, fmt.Sprintf("write -P %d %s", pat, at))
				case stCompressed:
					after = append(after, fmt.Sprintf("write -c -P %d %s", pat, at))
				case stZero:
					after = append(after, "write -z "+at)
				case stZeroAlloc:
					after = append(after, fmt.Sprintf("write -P %d %s", pat, at), "write -z "+at)
				}
				switch s {
				case stShared, stData, stCompressed:
					copy(shadow[c:c+cs], bytes.Repeat([]byte{byte(pat)}, cs))
				case stBackingOnly:
					copy(shadow[c:c+cs], backing[c:c+cs])
				}
			}
		}
		if len(before) > 0 {
			qio(t, img, before...)
		}
		tool(t, "qemu-img", "snapshot", "-c", "snap", img)
		qio(t, img, after...)
		compareRaw(t, img, shadow) // the states are as meant

		for _, op := range []string{"zero", "zero-unmap", "discard"} {
			t.Run(fmt.Sprintf("backing=%v/%s", withBacking, op), func(t *testing.T) {
				work := filepath.Join(t.TempDir(), "w.qcow2")
				tool(t, "cp", img, work)
				want := bytes.Clone(shadow)
				q := openRW(t, work)
				ctx := context.Background()
				for i, p := range pairs {
					boundary := int64(2*i+1) * cs
					off, n := boundary-p.d1, p.d1+p.d2
					var err error
					switch op {
					case "zero":
						err = q.WriteZeroes(ctx, off, n, false)
					case "zero-unmap":
						err = q.WriteZeroes(ctx, off, n, true)
					case "discard":
						err = q.Discard(ctx, off, n)
					}
					if err != nil {
						t.Fatalf("%s [%d, +%d) over %v|%v: %v", op, off, n, p.a, p.b, err)
					}
					if op == "discard" {
						// Whole clusters go (and read as zeroes, as in
						// QEMU); partial ones keep their data.
						a, b := q.wholeClusters(off, n)
						if a < b {
							clear(want[a*cs : b*cs])
						}
					} else {
						clear(want[off : off+n])
					}
					got := make([]byte, 2*cs)
					if _, err := q.ReadAt(ctx, got, boundary-cs); err != nil {
						t.Fatal(err)
					}
					if d := firstDiff(got, want[boundary-cs:boundary+cs]); d < len(got) {
						t.Fatalf("%s [%d, +%d) over %v|%v: byte %d of the pair reads %#x, want %#x",
							op, off, n, p.a, p.b, d, got[d], want[boundary-cs+int64(d)])
					}
				}
				if err := q.Close(); err != nil {
					t.Fatal(err)
				}
				checkClean(t, work)
				compareRaw(t, work, want)
			})
		}
	}
}
