package harness

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"
)

// KillLoad is what the writers of a [WritesUnderKill] do: Writers
// goroutines write whole blocks of BlockSize bytes at random over a disk
// of Blocks blocks (spread over it, so that most writes allocate), each
// calling fsync after every SyncEvery of its writes and punching a hole
// instead of writing once in PunchOneIn writes (never when 0).
//
// TornAt is where a write the kill interrupts may have been cut short:
// 0 when a block's write is stored whole or not at all (its data lies
// in one host page, as a qcow2 cluster of 4 KiB or more does); 512 when
// the format places data at any sector, so that a block's write spans
// two host pages and the kill may land between them (a VHD block's data
// starts one bitmap sector in: seen as a block holding its new value
// for 1536 bytes and its synced one after).
type KillLoad struct {
	BlockSize  int
	Blocks     int
	Writers    int
	SyncEvery  int
	PunchOneIn int
	TornAt     int
}

// WritesUnderKill runs writers on a writable export that is killed with
// SIGKILL under them, round after round, and knows what each block may
// read back afterwards. The rule, the one a disk's flush gives: a block
// whose last write its writer saw acknowledged by fsync reads back
// exactly that; a block written since its writer's last acknowledged
// fsync may read back as any value written to it since then, or as its
// last synced value, and nothing else: not a mix of them, but where
// [KillLoad.TornAt] allows a write to be cut short, each piece of that
// size holds one of them whole. The disk starts as zeroes, and a block
// no round wrote must still read as zeroes.
//
// A value v stands for the block filled with v as little-endian 64-bit
// words; 0 is a block of zeroes (a punched hole). Values name their
// round, block and sequence number, so that a block read back from the
// wrong place or the wrong time shows it.
type WritesUnderKill struct {
	load   KillLoad
	blocks []blockFate
}

// blockFate is what one block may hold. Each block is written by one
// writer only (block%Writers), so that its fate needs no lock while the
// writers run.
type blockFate struct {
	value   uint64   // the last synced value, or the one read back after a kill settled a doubt
	pieces  []uint64 // instead of value, one per piece, where a doubt settled as a torn write
	since   []uint64 // the values written since the last acknowledged fsync, in order
	written bool     // a writer wrote or punched it in some round
}

// synced is the value piece i of the block holds once synced.
func (f *blockFate) synced(i int) uint64 {
	if f.pieces != nil {
		return f.pieces[i]
	}
	return f.value
}

// KillCheck counts what [WritesUnderKill.Check] found.
type KillCheck struct {
	Synced  int // blocks a writer wrote in some round and not in doubt now (synced, or settled by an earlier check), read back exactly
	Zeroes  int // of those, the ones that hold zeroes (a synced punch, or a doubt settled as zeroes)
	InDoubt int // blocks written since their last acknowledged fsync, read back as one of their candidates
	Torn    int // of those, the ones a write the kill cut short left in pieces of two values (only where TornAt allows)
}

// NewWritesUnderKill starts the ledger of a fresh disk (all zeroes)
// written as load says.
func NewWritesUnderKill(load KillLoad) *WritesUnderKill {
	return &WritesUnderKill{load: load, blocks: make([]blockFate, load.Blocks)}
}

// Round exports image read-write on mnt, runs the writers on it, kills
// the exporter with SIGKILL after killAfter, and returns once the writers
// have stopped (their first failed call), the exporter is reaped, its
// mount is gone and the image is no longer locked: ready for qemu-img.
func (w *WritesUnderKill) Round(t *testing.T, round int, image, mnt string, killAfter time.Duration) {
	t.Helper()
	d := StartExport(t, image, mnt, "-w")
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("round %d: opening the export: %v", round, err)
	}
	var wg sync.WaitGroup
	for writer := range w.load.Writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.write(f, round, writer)
		}()
	}
	time.Sleep(killAfter)
	d.Cmd.Process.Signal(syscall.SIGKILL)
	wg.Wait()
	f.Close()
	d.Wait(10 * time.Second)
	syscall.Unmount(mnt, syscall.MNT_DETACH)
	WaitUnlocked(t, image)
}

// write is one writer: it writes and punches its own blocks until a call
// fails (the exporter is gone). A value joins its block's candidates
// before the call that may store it starts, and becomes the block's
// synced value only once a later fsync returned.
func (w *WritesUnderKill) write(f *os.File, round, writer int) {
	bs, n := w.load.BlockSize, w.load.Writers
	r := rand.New(rand.NewPCG(uint64(round), uint64(writer)))
	buf := make([]byte, bs)
	var unsynced []int
	for seq := uint64(1); ; seq++ {
		b := writer + n*r.IntN(w.load.Blocks/n)
		v := uint64(round)<<40 | uint64(b)<<20 | seq
		punch := w.load.PunchOneIn > 0 && r.IntN(w.load.PunchOneIn) == 0
		if punch {
			v = 0
		}
		fate := &w.blocks[b]
		fate.since = append(fate.since, v)
		fate.written = true
		unsynced = append(unsynced, b)
		if punch {
			// FALLOC_FL_KEEP_SIZE|FALLOC_FL_PUNCH_HOLE: write-zeroes.
			if err := syscall.Fallocate(int(f.Fd()), 0x01|0x02, int64(b)*int64(bs), int64(bs)); err != nil {
				return
			}
		} else {
			fill(buf, v)
			if _, err := f.WriteAt(buf, int64(b)*int64(bs)); err != nil {
				return
			}
		}
		if seq%uint64(w.load.SyncEvery) == 0 {
			if err := f.Sync(); err != nil {
				return
			}
			for _, b := range unsynced {
				fate := &w.blocks[b]
				if len(fate.since) > 0 {
					fate.value, fate.pieces = fate.since[len(fate.since)-1], nil
					fate.since = fate.since[:0]
				}
			}
			unsynced = unsynced[:0]
		}
	}
}

// Check fails the test unless every block of content (the disk read back
// after round's kill) holds what the rule allows. Blocks in doubt are
// settled to what they hold, which is what the next round starts from.
func (w *WritesUnderKill) Check(t *testing.T, round int, content []byte) KillCheck {
	t.Helper()
	bs, piece := w.load.BlockSize, w.load.TornAt
	if piece == 0 {
		piece = bs
	}
	if len(content) != bs*len(w.blocks) {
		t.Fatalf("round %d: the disk reads back %d bytes, want %d", round, len(content), bs*len(w.blocks))
	}
	var got KillCheck
	want := make([]byte, piece)
	holds := func(p []byte, v uint64) bool {
		fill(want, v)
		return bytes.Equal(p, want)
	}
	for b := range w.blocks {
		fate := &w.blocks[b]
		block := content[b*bs : (b+1)*bs]
		if len(fate.since) == 0 {
			for i := 0; i < bs/piece; i++ {
				if p := block[i*piece : (i+1)*piece]; !holds(p, fate.synced(i)) {
					t.Fatalf("round %d: block %d, synced, holds other than %#x at byte %d: it reads back as %s", round, b, fate.synced(i), i*piece, words(block))
				}
			}
			if fate.written {
				got.Synced++
				if fate.pieces == nil && fate.value == 0 {
					got.Zeroes++
				}
			}
			continue
		}
		pieces := make([]uint64, bs/piece)
		for i := range pieces {
			p := block[i*piece : (i+1)*piece]
			candidates := append([]uint64{fate.synced(i)}, fate.since...)
			k := slices.IndexFunc(candidates, func(v uint64) bool { return holds(p, v) })
			if k < 0 {
				t.Fatalf("round %d: block %d, synced as %#x and written since as %#x, reads back as %s", round, b, fate.synced(i), fate.since, words(block))
			}
			pieces[i] = candidates[k]
		}
		fate.since = nil
		if slices.Equal(pieces, slices.Repeat(pieces[:1], len(pieces))) {
			fate.value, fate.pieces = pieces[0], nil
		} else {
			fate.pieces = pieces
			got.Torn++
		}
		got.InDoubt++
	}
	return got
}

// fill writes v into every 64-bit word of block.
func fill(block []byte, v uint64) {
	for j := 0; j+8 <= len(block); j += 8 {
		binary.LittleEndian.PutUint64(block[j:], v)
	}
}

// words says what block holds: its first word, and where another word
// starts, if one does (a torn or scribbled block).
func words(block []byte) string {
	first := binary.LittleEndian.Uint64(block)
	for j := 8; j+8 <= len(block); j += 8 {
		if w := binary.LittleEndian.Uint64(block[j:]); w != first {
			return fmt.Sprintf("%#x, then %#x from byte %d", first, w, j)
		}
	}
	return fmt.Sprintf("%#x throughout", first)
}

// String is the round's log line.
func (c KillCheck) String() string {
	return fmt.Sprintf("%d synced blocks read back (%d of them zeroes), %d in doubt each read back as its values allow (%d torn)", c.Synced, c.Zeroes, c.InDoubt, c.Torn)
}
