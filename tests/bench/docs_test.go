package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const page = `# Title

Text before, kept as is; prose may quote <!-- bench:begin a --> mid-line.

<!-- bench:begin a -->
From [old](old.md): a.

| a | old |
<!-- bench:end a -->

Between.
<!-- bench:begin b -->
From [old](old.md): b.
<!-- bench:end b -->
<!-- bench:begin c -->
<!-- bench:end c -->
tail without a newline`

func TestReplaceBlocksOnlyTheAreasGiven(t *testing.T) {
	got, err := replaceBlocks(page, map[string]string{
		"a": "From [new](new.md): a.\n\n| a | new |\n",
		"c": "no newline at the end", // one is added: the end marker keeps its line
	})
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Replace(page, "From [old](old.md): a.\n\n| a | old |\n", "From [new](new.md): a.\n\n| a | new |\n", 1)
	want = strings.Replace(want, "<!-- bench:begin c -->\n", "<!-- bench:begin c -->\nno newline at the end\n", 1)
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
	// b did not run: its block, and all outside the blocks, byte for byte.
	if !strings.Contains(got, "<!-- bench:begin b -->\nFrom [old](old.md): b.\n<!-- bench:end b -->\n") {
		t.Errorf("block b changed:\n%s", got)
	}
}

func TestReplaceBlocksNothingRan(t *testing.T) {
	for _, in := range []string{page, page + "\n", strings.ReplaceAll(page, "\n", "\r\n")} {
		got, err := replaceBlocks(in, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got != in {
			t.Errorf("changed with no area given:\n%q\nwant\n%q", got, in)
		}
	}
}

func TestReplaceBlocksRefusesBrokenMarkers(t *testing.T) {
	begin, end := "<!-- bench:begin a -->\n", "<!-- bench:end a -->\n"
	for name, in := range map[string]string{
		"end without begin":  "x\n" + end,
		"begin never ends":   begin + "x\n",
		"nested":             begin + "<!-- bench:begin b -->\n<!-- bench:end b -->\n" + end,
		"ends another":       begin + "<!-- bench:end b -->\n",
		"marked twice":       begin + end + begin + end,
		"malformed":          "<!-- bench:begin a-->\n" + end,
		"text after marker":  "<!-- bench:begin a --> x\n" + end,
		"area not in page":   "<!-- bench:begin b -->\n<!-- bench:end b -->\n",
		"upper-case area":    "<!-- bench:begin A -->\n<!-- bench:end A -->\n" + begin + end,
		"end before begin":   end + begin,
		"begin, end missing": begin + "<!-- bench:begin a -->\n",
	} {
		if got, err := replaceBlocks(in, map[string]string{"a": "new\n"}); err == nil {
			t.Errorf("%s: no error; got\n%s", name, got)
		}
	}
}

// The real page has one balanced block for every area the harness fills,
// and no marker of an area it does not know.
func TestReadmeHasEveryArea(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "bench", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	all := map[string]string{}
	for _, a := range docAreas() {
		known[a.id] = true
		all[a.id] = "placeholder " + a.id + "\n"
	}
	// A new area in the default run needs its block too.
	for _, target := range strings.Split(defaultOnly, ",") {
		if !known[target] {
			t.Errorf("the area %s has no entry in docAreas", target)
		}
	}
	got, err := replaceBlocks(string(b), all)
	if err != nil {
		t.Fatal(err)
	}
	for id := range known {
		if !strings.Contains(got, "<!-- bench:begin "+id+" -->\nplaceholder "+id+"\n<!-- bench:end "+id+" -->\n") {
			t.Errorf("README.md: no block for %s", id)
		}
	}
	for _, l := range strings.Split(string(b), "\n") {
		if m := markerLine.FindStringSubmatch(l); m != nil && !known[m[2]] {
			t.Errorf("README.md: marker of an unknown area: %s", l)
		}
	}
}

// updateReadme rewrites the covered areas that made rows, with the
// report's table, and no other.
func TestUpdateReadme(t *testing.T) {
	path := filepath.Join(t.TempDir(), "README.md")
	in := "# x\n\n<!-- bench:begin s3 -->\nold s3\n<!-- bench:end s3 -->\n\n<!-- bench:begin nbd -->\nold nbd\n<!-- bench:end nbd -->\n\n<!-- bench:begin http -->\nold http\n<!-- bench:end http -->\n"
	if err := os.WriteFile(path, []byte(in), 0o644); err != nil {
		t.Fatal(err)
	}
	rows := []row{
		{target: "s3", area: "s3", name: "R rand aio cold", unit: "IOPS", ours: 2400, higherBetter: true},
		{target: "nbd raw", area: "nbd", name: "read 4k iodepth 16", unit: "IOPS", ours: 2000, qemu: 1000, qemuConfig: "qemu-nbd", qemuAll: []measured{{"qemu-nbd", 1000}}, higherBetter: true},
	}
	// http ran but made no rows: its old table stays.
	areas, err := updateReadme(path, "STAMP", "Machine: M.", rows, map[string]bool{"s3": true, "http": true})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(areas, ",") != "s3" {
		t.Errorf("rewrote %v, want [s3]", areas)
	}
	out, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var s3 docArea
	for _, a := range docAreas() {
		if a.id == "s3" {
			s3 = a
		}
	}
	want := strings.Replace(in, "old s3\n", "From [STAMP](STAMP.md): "+s3.what+". Machine: M.\n\n"+ratioTable(rows[:1]), 1)
	if string(out) != want {
		t.Errorf("got\n%s\nwant\n%s", out, want)
	}
	if !strings.Contains(string(out), "| s3 | R rand aio cold | — | 2.4k | — |\n") {
		t.Errorf("a row with nothing to compare with is not dashed:\n%s", out)
	}
}
