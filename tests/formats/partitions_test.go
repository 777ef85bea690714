package formats

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// partitionScripts are sfdisk scripts for the two kinds of table: MBR with an
// extended partition holding two logical ones (numbered 5 and 6, as the
// kernel numbers them), and GPT. Each names the file system each
// partition gets.
var partitionScripts = map[string]struct {
	script string
	fs     map[int]string // partition number: ext4 or vfat
}{
	"mbr": {"label: dos\n,8M,83\n,36M,5\n,,c\n,10M,83\n,,b\n", map[int]string{1: "ext4", 3: "vfat", 5: "ext4", 6: "vfat"}},
	"gpt": {"label: gpt\n,8M,L\n,12M,U\n,,L\n", map[int]string{1: "ext4", 2: "vfat", 3: "ext4"}},
}

// partitionRange is a partition as partx (libblkid, not our parser) reads it.
type partitionRange struct {
	nr          int
	start, size int64
}

// partitionedDisk makes a 64 MiB disk of random bytes (so that a stray write
// shows) with the kind's table written by sfdisk.
func partitionedDisk(t *testing.T, dir, kind string) string {
	t.Helper()
	disk := harness.RandomImage(t, dir, 64<<20, 26)
	cmd := exec.Command("sfdisk", "-q", "--no-reread", "--no-tell-kernel", disk)
	cmd.Stdin = strings.NewReader(partitionScripts[kind].script)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("sfdisk %s: %v\n%s", kind, err, out)
	}
	return disk
}

// partitionRanges lists the data partitions of disk as partx reads them (the
// MBR's extended container left out: we serve no file for it).
func partitionRanges(t *testing.T, disk string) []partitionRange {
	t.Helper()
	var out []partitionRange
	for _, line := range strings.Split(strings.TrimSpace(harness.Run(t, "partx", "-g", "-b", "-o", "NR,START,SECTORS,TYPE", disk)), "\n") {
		f := strings.Fields(line)
		if len(f) != 4 || f[3] == "0x5" || f[3] == "0xf" || f[3] == "0x85" {
			continue
		}
		nr, _ := strconv.Atoi(f[0])
		start, _ := strconv.ParseInt(f[1], 10, 64)
		n, _ := strconv.ParseInt(f[2], 10, 64)
		out = append(out, partitionRange{nr, start * 512, n * 512})
	}
	if len(out) == 0 {
		t.Fatalf("partx found no partitions on %s", disk)
	}
	return out
}

// kernelPartitionDevice returns a block device holding the kernel's view of
// partition p of disk: /dev/loopNpK from `losetup -P` where the kernel
// reads partition tables (a device node made for it when no udev does),
// else a loop device over p's byte range as partx gives it (this
// machine's kernel is built without MSDOS and EFI partition support, so
// `losetup -P` finds no partitions here). Loop devices and nodes go in
// t.Cleanup.
func kernelPartitionDevice(t *testing.T, disk string, p partitionRange) string {
	t.Helper()
	loop := strings.TrimSpace(harness.Run(t, "losetup", "-f", "--show", "-r", "-P", disk))
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	name := filepath.Base(loop)
	if dev, err := os.ReadFile(fmt.Sprintf("/sys/block/%s/%sp%d/dev", name, name, p.nr)); err == nil {
		node := fmt.Sprintf("/dev/%sp%d", name, p.nr)
		if _, err := os.Stat(node); err != nil {
			node = filepath.Join(t.TempDir(), fmt.Sprintf("%sp%d", name, p.nr))
			mm := strings.Split(strings.TrimSpace(string(dev)), ":")
			harness.Run(t, "mknod", node, "b", mm[0], mm[1])
		}
		return node
	}
	t.Logf("the kernel made no %sp%d (no partition support for this table): a loop device over partx's range instead", name, p.nr)
	part := strings.TrimSpace(harness.Run(t, "losetup", "-f", "--show", "-r", "-o", strconv.FormatInt(p.start, 10), "--sizelimit", strconv.FormatInt(p.size, 10), disk))
	t.Cleanup(func() { exec.Command("losetup", "-d", part).Run() })
	return part
}

// mkfsOn makes the file system named on path (a partition file).
func mkfsOn(t *testing.T, fs, path, content string) {
	t.Helper()
	switch fs {
	case "ext4":
		harness.Run(t, "mkfs.ext4", "-q", "-F", "-d", content, path)
	case "vfat":
		harness.Run(t, "mkfs.vfat", path)
	}
}

// partitionContent is a directory of files for mkfs.ext4 -d.
func partitionContent(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, name := range []string{"hello.txt", "partitions-as-files"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("made through "+name+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestPartitionFilesEqualTheKernelsPartitions: for an MBR disk with logical
// partitions and a GPT disk, raw and qcow2, --partitions puts NAME-pN
// beside NAME for exactly the partitions partx finds, each of its
// partition's size; file systems made through them (ext4 and vfat) land
// inside their partition and nowhere else (every other byte of the disk
// unchanged after each); and once the export is stopped, each file of a
// read-only export equals the kernel's block device for the partition
// byte for byte (cmp), and fsck passes on that device.
func TestPartitionFilesEqualTheKernelsPartitions(t *testing.T) {
	for _, c := range []struct{ kind, format string }{{"mbr", "raw"}, {"gpt", "raw"}, {"mbr", "qcow2"}, {"gpt", "qcow2"}} {
		kind := c.kind
		t.Run(kind+"-"+c.format, func(t *testing.T) {
			dir := t.TempDir()
			disk := partitionedDisk(t, dir, kind)
			parts := partitionRanges(t, disk)
			image := disk
			if c.format == "qcow2" {
				image = filepath.Join(dir, "disk.qcow2")
				harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", disk, image)
			}
			mnt := filepath.Join(dir, "mnt")
			os.Mkdir(mnt, 0o755)
			d := harness.StartExport(t, image, mnt, "-f", c.format, "-w", "--file-name", "disk", "--partitions")

			entries, err := os.ReadDir(mnt)
			if err != nil {
				t.Fatal(err)
			}
			var got, want []string
			for _, e := range entries {
				got = append(got, e.Name())
			}
			want = append(want, "disk")
			for _, p := range parts {
				want = append(want, fmt.Sprintf("disk-p%d", p.nr))
			}
			sort.Strings(want)
			if strings.Join(got, " ") != strings.Join(want, " ") {
				t.Fatalf("the directory lists %q; partx finds %q", got, want)
			}
			content := partitionContent(t)
			for _, p := range parts {
				file := filepath.Join(mnt, fmt.Sprintf("disk-p%d", p.nr))
				st, err := os.Stat(file)
				if err != nil {
					t.Fatal(err)
				}
				if st.Size() != p.size || st.Mode().Perm() != 0o600 {
					t.Errorf("%s: size %d mode %v; partx: %d bytes", file, st.Size(), st.Mode(), p.size)
				}
				before := harness.ReadAll(t, filepath.Join(mnt, "disk"))
				mkfsOn(t, partitionScripts[kind].fs[p.nr], file, content)
				after := harness.ReadAll(t, filepath.Join(mnt, "disk"))
				harness.MustEqualBytes(t, fmt.Sprintf("the disk before partition %d", p.nr), after[:p.start], before[:p.start])
				harness.MustEqualBytes(t, fmt.Sprintf("the disk after partition %d", p.nr), after[p.start+p.size:], before[p.start+p.size:])
				if bytes.Equal(after[p.start:p.start+p.size], before[p.start:p.start+p.size]) {
					t.Fatalf("mkfs through %s changed nothing in its partition", file)
				}
			}
			d.StopClean()
			if c.format == "qcow2" {
				harness.Run(t, "qemu-img", "convert", "-f", "qcow2", "-O", "raw", image, disk)
			}
			harness.StartExport(t, image, mnt, "-f", c.format, "--file-name", "disk", "--partitions")
			for _, p := range parts {
				dev := kernelPartitionDevice(t, disk, p)
				file := filepath.Join(mnt, fmt.Sprintf("disk-p%d", p.nr))
				if out, err := exec.Command("cmp", file, dev).CombinedOutput(); err != nil {
					t.Errorf("cmp %s %s: %v\n%s", file, dev, err, out)
				}
				switch partitionScripts[kind].fs[p.nr] {
				case "ext4":
					harness.Run(t, "e2fsck", "-fn", dev)
				case "vfat":
					harness.Run(t, "fsck.vfat", "-n", dev)
				}
			}
		})
	}
}

// TestPartitionServedAloneAndAsNBDExports: --partition N serves partition N alone (fuse
// without a directory, and nbd), and nbd --partitions lists every
// partition as an export name (nbdinfo --list) whose bytes are the
// partition's (qemu-img convert from it, compared with the disk's range).
func TestPartitionServedAloneAndAsNBDExports(t *testing.T) {
	dir := t.TempDir()
	disk := partitionedDisk(t, dir, "mbr")
	parts := partitionRanges(t, disk)
	data := harness.ReadAll(t, disk)
	p5 := parts[len(parts)-2]
	if p5.nr != 5 {
		t.Fatalf("partx: %+v", parts)
	}

	file := filepath.Join(dir, "p5")
	harness.StartExport(t, disk, file, "-f", "raw", "--partition", "5")
	harness.MustEqualBytes(t, "--partition 5's file", harness.ReadAll(t, file), data[p5.start:p5.start+p5.size])

	s := harness.StartNBD(t, disk, false, "-f", "raw", "--export-name", "disk", "--partitions")
	sock := strings.TrimPrefix(s.URI, "nbd+unix:///?socket=")
	list := harness.Run(t, "nbdinfo", "--list", "--json", "nbd+unix:///?socket="+sock)
	for _, p := range parts {
		name := fmt.Sprintf("disk-p%d", p.nr)
		if !strings.Contains(list, `"`+name+`"`) {
			t.Errorf("nbdinfo --list has no %s:\n%s", name, list)
			continue
		}
		out := filepath.Join(dir, name+".raw")
		harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "raw", fmt.Sprintf("nbd+unix:///%s?socket=%s", name, sock), out)
		harness.MustEqualBytes(t, "export "+name, harness.ReadAll(t, out), data[p.start:p.start+p.size])
	}
	if !strings.Contains(list, `"disk"`) {
		t.Errorf("nbdinfo --list has no disk:\n%s", list)
	}

	one := harness.StartNBD(t, disk, false, "-f", "raw", "--partition", "6")
	p6 := parts[len(parts)-1]
	if size := strings.TrimSpace(harness.Run(t, "nbdinfo", "--size", one.URI)); size != strconv.FormatInt(p6.size, 10) {
		t.Errorf("nbd --partition 6: size %s, partx %d", size, p6.size)
	}
}

// TestPartitionTablesNotSoundAreRefused: what is not a sound table is refused with one line
// and no mount: no table at all, overlapping partitions, a GPT whose
// primary and backup headers are both damaged, a partition number the
// table lacks, and --partitions without a directory. A GPT whose primary
// alone is damaged is read from the backup, with a warning.
func TestPartitionTablesNotSoundAreRefused(t *testing.T) {
	dir := t.TempDir()
	noTable := harness.RandomImage(t, dir, 1<<20, 1)
	overlap := harness.SparseImage(t, dir, "overlap.raw", 8<<20)
	// sfdisk writes no overlaps: a sound table, then entry 2's start
	// (LBA, little-endian at 446+16+8) moved from 8192 to 4000, into p1.
	cmd := exec.Command("sfdisk", "-q", "--no-reread", "--no-tell-kernel", overlap)
	cmd.Stdin = strings.NewReader("label: dos\n2048,4096,83\n8192,4096,83\n")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("sfdisk: %v\n%s", err, out)
	}
	f, err := os.OpenFile(overlap, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{0xa0, 0x0f, 0, 0}, 446+16+8); err != nil {
		t.Fatal(err)
	}
	f.Close()
	gptDisk := func(name string, damage ...int64) string {
		path := harness.SparseImage(t, dir, name, 8<<20)
		cmd := exec.Command("sfdisk", "-q", "--no-reread", "--no-tell-kernel", path)
		cmd.Stdin = strings.NewReader("label: gpt\n,2M,L\n,,L\n")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("sfdisk: %v\n%s", err, out)
		}
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		for _, off := range damage {
			b := make([]byte, 1)
			f.ReadAt(b, off)
			b[0] ^= 0xff
			f.WriteAt(b, off)
		}
		return path
	}
	lastLBA := int64(8<<20 - 512)
	primaryBad := gptDisk("primary-bad.raw", 512+24)           // my_lba, under the header CRC
	bothBad := gptDisk("both-bad.raw", 512+24, lastLBA+24)     // and the backup's
	entriesBad := gptDisk("entries-bad.raw", 1024+32, lastLBA) // primary entries, backup signature

	for _, c := range []struct {
		name, image, want string
		args              []string
	}{
		{"no table", noTable, "no partition table", []string{"--file-name", "d", "--partitions"}},
		{"overlap", overlap, "overlap", []string{"--file-name", "d", "--partitions"}},
		{"both GPT headers damaged", bothBad, "no valid GPT header", []string{"--partition", "1"}},
		{"primary entries and backup damaged", entriesBad, "no valid GPT header", []string{"--partition", "1"}},
		{"no such partition", primaryBad, "no such partition", []string{"--partition", "7"}},
		{"partition 0", primaryBad, "numbered from 1", []string{"--partition", "0"}},
		{"no directory", primaryBad, "needs --file-name", []string{"--partitions"}},
	} {
		mnt := filepath.Join(dir, "mnt-"+strings.ReplaceAll(c.name, " ", "-"))
		code, out := harness.RunBlockexport(t, append(append([]string{"fuse", "-f", "raw"}, c.args...), c.image, mnt)...)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if code == 0 || !strings.Contains(out, c.want) || len(lines) > 2 || harness.IsFuseMount(mnt) {
			t.Errorf("%s: exit %d, want a refusal saying %q in one line:\n%s", c.name, code, c.want, out)
		}
	}

	mnt := filepath.Join(dir, "mnt")
	os.Mkdir(mnt, 0o755)
	d := harness.StartExport(t, primaryBad, mnt, "-f", "raw", "--file-name", "d", "--partitions")
	if !strings.Contains(d.Log(), "backup GPT") {
		t.Errorf("no warning that the backup GPT is used:\n%s", d.Log())
	}
	for _, p := range partitionRanges(t, primaryBad) {
		st, err := os.Stat(filepath.Join(mnt, fmt.Sprintf("d-p%d", p.nr)))
		if err != nil || st.Size() != p.size {
			t.Errorf("d-p%d from the backup GPT: %v (partx: %d bytes)", p.nr, err, p.size)
		}
	}
}

// TestPartitionFilesMountedByFuse2fsWithoutRoot: no root anywhere on the way from a disk
// image to its files. As the unprivileged test user, a VMDK and a qcow2
// disk (an MBR disk whose logical partition 5 holds ext4) are exported
// with --partitions, and fuse2fs -o fakeroot on NAME-p5 lists and reads
// the file system's files.
func TestPartitionFilesMountedByFuse2fsWithoutRoot(t *testing.T) {
	u := harness.Unprivileged(t)
	dir := t.TempDir()
	disk := partitionedDisk(t, dir, "mbr")
	var p5 partitionRange
	for _, p := range partitionRanges(t, disk) {
		if p.nr == 5 {
			p5 = p
		}
	}
	// The file system is made apart and copied into place, so that
	// nothing but the user's processes ever serves the disk.
	fsImg := filepath.Join(dir, "p5.ext4")
	harness.Run(t, "truncate", "-s", strconv.FormatInt(p5.size, 10), fsImg)
	mkfsOn(t, "ext4", fsImg, partitionContent(t))
	fsData := harness.ReadAll(t, fsImg)
	f, err := os.OpenFile(disk, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(fsData, p5.start); err != nil {
		t.Fatal(err)
	}
	f.Close()
	for _, format := range []string{"vmdk", "qcow2"} {
		t.Run(format, func(t *testing.T) {
			image := filepath.Join(u.Dir, "disk."+format)
			harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", format, disk, image)
			if err := os.Chown(image, u.UID, u.GID); err != nil {
				t.Fatal(err)
			}
			mnt := filepath.Join(u.Dir, "export-"+format)
			fsMnt := filepath.Join(u.Dir, "fs-"+format)
			u.Run(t, "mkdir", mnt, fsMnt)

			d := u.Export(t, image, mnt, "-f", format, "--file-name", "disk", "--partitions")
			t.Cleanup(func() {
				if harness.IsFuseMount(fsMnt) {
					exec.Command("setpriv", u.Argv("fusermount3", "-u", fsMnt)...).Run()
				}
				if harness.IsFuseMount(fsMnt) {
					exec.Command("umount", "-l", fsMnt).Run()
				}
			})
			u.Run(t, "fuse2fs", "-o", "fakeroot,ro", filepath.Join(mnt, "disk-p5"), fsMnt)
			ls := u.Run(t, "ls", fsMnt)
			for _, name := range []string{"hello.txt", "partitions-as-files"} {
				if !strings.Contains(ls, name) {
					t.Errorf("fuse2fs on disk-p5 lists %q, no %s\n%s", ls, name, d.Log())
				}
			}
			if got := u.Run(t, "cat", filepath.Join(fsMnt, "hello.txt")); got != "made through hello.txt\n" {
				t.Errorf("hello.txt reads %q", got)
			}
			u.Run(t, "fusermount3", "-u", fsMnt)
			if ps := harness.Run(t, "ps", "-o", "user=", "-p", strconv.Itoa(d.Cmd.Process.Pid)); strings.TrimSpace(ps) == "root" {
				t.Errorf("the export runs as root")
			}
			d.StopClean()
		})
	}
}

// TestPartitionedDiskSizeIsFixed: beside its partitions' files the disk's size is
// fixed (the files are ranges read from the table at that size):
// truncating the disk's file, shorter or longer, fails and changes
// nothing, where without --partitions it resizes the image.
func TestPartitionedDiskSizeIsFixed(t *testing.T) {
	dir := t.TempDir()
	disk := partitionedDisk(t, dir, "gpt")
	mnt := filepath.Join(dir, "mnt")
	os.Mkdir(mnt, 0o755)
	d := harness.StartExport(t, disk, mnt, "-f", "raw", "-w", "--file-name", "disk", "--partitions")
	for _, size := range []int64{32 << 20, 128 << 20} {
		if err := os.Truncate(filepath.Join(mnt, "disk"), size); err == nil {
			t.Errorf("truncating the disk to %d beside its partitions succeeded", size)
		}
		if st, err := os.Stat(disk); err != nil || st.Size() != 64<<20 {
			t.Errorf("after a truncate to %d the image is %v bytes (%v)", size, st.Size(), err)
		}
	}
	if err := os.Truncate(filepath.Join(mnt, "disk-p1"), 1<<20); err == nil {
		t.Error("truncating a partition's file succeeded")
	}
	d.StopClean()
	harness.StartExport(t, disk, mnt, "-f", "raw", "-w", "--file-name", "disk")
	if err := os.Truncate(filepath.Join(mnt, "disk"), 128<<20); err != nil {
		t.Fatalf("truncating the disk without --partitions: %v", err)
	}
}
