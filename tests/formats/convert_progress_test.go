package formats

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestConvertProgressAsQemuImg: convert -p with stdout not a terminal
// prints what qemu-img convert -p prints, byte for byte: "    (P/100%)\r"
// each time the copy has come more than 1% further, counted in the
// pieces qemu-img counts, then a newline; compressed, with -S 0 and to
// raw too.
func TestConvertProgressAsQemuImg(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "frag.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", src, "100M")
	args := []string{"-f", "qcow2"}
	for i := range 38 {
		args = append(args, "-c", fmt.Sprintf("write -P %d %dk %dk", i, i*2531, i*37+3))
	}
	harness.Run(t, "qemu-io", append(args, src)...)
	for _, c := range [][]string{
		{"-O", "raw"}, {"-O", "qcow2"}, {"-O", "qcow2", "-c"}, {"-O", "raw", "-S", "0"}, {"-O", "qcow2", "-S", "64k"},
	} {
		argv := append(append([]string{"convert", "-p"}, c...), src)
		want, err := exec.Command("qemu-img", append(argv, filepath.Join(dir, "qemu.out"))...).Output()
		if err != nil {
			t.Fatalf("qemu-img %v: %v", argv, err)
		}
		got, err := exec.Command(harness.Bin, append(argv, filepath.Join(dir, "ours.out"))...).Output()
		if err != nil {
			t.Fatalf("blockexport %v: %v", argv, err)
		}
		if string(got) != string(want) {
			t.Errorf("%v prints\n%q\nqemu-img prints\n%q", argv, got, want)
		}
	}
}
