// Package tests holds blockexport's end-to-end tests: real FUSE mounts of the
// built binary, driven by real clients (fio, qemu-img, losetup, mkfs.ext4,
// e2fsck), with qemu-storage-daemon as the oracle where behaviour must match
// QEMU's. They need root, /dev/fuse and the tools listed in requiredTools;
// the README's test command installs those.
package tests
