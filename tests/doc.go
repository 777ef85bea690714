// Package tests holds no code: its subpackages are blockexport's end-to-end
// tests, real FUSE mounts and NBD servers of the built binary driven by
// real clients (fio, qemu-img, losetup, mkfs.ext4, e2fsck), with QEMU
// (qemu-img, qemu-storage-daemon) as the oracle where behaviour must match
// QEMU's. They need root, /dev/fuse and the tools .ci/deps installs.
//
//	fuse         the exported file as clients see it; make test runs it
//	             uncached and with the kernel cache on
//	daemon       the fuse process: arguments, signals, logs, locks,
//	             unprivileged mounts, queues, mapped reads
//	kernelcache  --kernel-cache
//	nbd          NBD as a server and as an image source
//	formats      qcow2, vmdk, vhdx, vpc, vdi, partitions; info, map,
//	             check, create, convert, compare
//	remote       HTTP(S) and S3 images; copy-on-read and stream
//	cli          usage, messages, man pages, completion
//	internal/harness  what they share (each package's TestMain is harness.Main)
//	bench        the side-by-side benchmark (make bench), not a test
package tests
