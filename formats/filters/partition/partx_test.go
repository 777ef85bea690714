package partition

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// partxList is what partx (util-linux's libblkid: a reader of its own)
// finds on path: "N:start:size" per data partition, the MBR's extended
// container left out as we leave it out.
func partxList(path string) (string, error) {
	out, err := exec.Command("partx", "-g", "-b", "-o", "NR,START,SECTORS,TYPE", path).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%v: %s", err, out)
	}
	var l []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) != 4 || f[3] == "0x5" || f[3] == "0xf" || f[3] == "0x85" {
			continue
		}
		start, _ := strconv.ParseInt(f[1], 10, 64)
		n, _ := strconv.ParseInt(f[2], 10, 64)
		l = append(l, fmt.Sprintf("%s:%d:%d", f[0], start*512, n*512))
	}
	return strings.Join(l, " "), nil
}

func ourList(tab *Table) string {
	var l []string
	for _, p := range tab.Partitions {
		l = append(l, fmt.Sprintf("%d:%d:%d", p.Number, p.Start, p.Size))
	}
	return strings.Join(l, " ")
}

// TestPartDifferentialPartx: tables sfdisk writes (MBR with logical
// partitions, GPT), and 200 variants of each with bytes of the table
// flipped at random, read by us and by partx. Where we accept a table,
// partx must find the same partitions, numbered the same, at the same
// bytes: what we serve is what another reader of the table sees (on
// tables partx reads and we refuse, we are the stricter).
func TestPartDifferentialPartx(t *testing.T) {
	if _, err := exec.LookPath("sfdisk"); err != nil {
		t.Fatal("sfdisk (package fdisk) is needed: .ci/deps installs it")
	}
	dir := t.TempDir()
	scripts := map[string]string{
		"mbr": "label: dos\n,1M,83\n,5M,5\n,,c\n,1M,83\n,,82\n",
		"gpt": "label: gpt\n,1M,L\n,2M,U\n,,L\n",
	}
	rng := rand.New(rand.NewPCG(26, 1))
	for kind, script := range scripts {
		path := filepath.Join(dir, kind+".raw")
		if err := os.WriteFile(path, make([]byte, 8<<20), 0o600); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("sfdisk", "-q", "--no-reread", "--no-tell-kernel", path)
		cmd.Stdin = strings.NewReader(script)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("sfdisk: %v\n%s", err, out)
		}
		orig, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		// Where the table lives: the MBR, each EBR, the GPT headers and
		// the first entries of both arrays.
		var spots [][2]int
		if kind == "mbr" {
			spots = append(spots, [2]int{446, 512})
			tab, err := Parse(context.Background(), &memImage{b: orig})
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range tab.Partitions {
				if p.Logical {
					ebr := int(p.Start) - 1<<20 // the EBR lies 1 MiB before its partition (sfdisk's alignment)
					if ebr > 0 {
						spots = append(spots, [2]int{ebr + 446, ebr + 512})
					}
				}
			}
		} else {
			last := len(orig) - 512
			spots = append(spots, [2]int{512, 512 + 92}, [2]int{1024, 1024 + 384}, [2]int{last, last + 92}, [2]int{last - 32*512, last - 32*512 + 384})
		}
		accepted := 0
		for i := 0; i <= 200; i++ {
			d := append([]byte(nil), orig...)
			if i > 0 {
				for n := 1 + rng.IntN(3); n > 0; n-- {
					s := spots[rng.IntN(len(spots))]
					d[s[0]+rng.IntN(s[1]-s[0])] ^= byte(1 << rng.IntN(8))
				}
			}
			tab, err := Parse(context.Background(), &memImage{b: d})
			if err != nil {
				if i == 0 {
					t.Fatalf("%s: sfdisk's own table refused: %v", kind, err)
				}
				continue
			}
			accepted++
			if err := os.WriteFile(path, d, 0o600); err != nil {
				t.Fatal(err)
			}
			theirs, err := partxList(path)
			if err != nil {
				t.Errorf("%s variant %d: we read %q, partx fails: %v", kind, i, ourList(tab), err)
				continue
			}
			if ours := ourList(tab); ours != theirs {
				t.Errorf("%s variant %d: we read %q, partx %q", kind, i, ours, theirs)
			}
		}
		t.Logf("%s: %d of 201 tables accepted and compared", kind, accepted)
	}
}
