package aio

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Permissions an image user holds, numbered as QEMU numbers them in the
// bytes it locks on image files, so that QEMU and blockexport see each
// other: holding permission i takes a shared OFD lock on byte 100+i, and
// refusing to share it with others takes one on byte 200+i.
const (
	PermConsistentRead = 1 << 0
	PermWrite          = 1 << 1
	PermWriteUnchanged = 1 << 2
	PermResize         = 1 << 3
)

const (
	lockPermBase   = 100
	lockSharedBase = 200
	permBits       = 4
)

// Lock is what an opener holds on an image file and what it will not share.
type Lock struct {
	Perm     uint8 // Perm* bits held
	Unshared uint8 // Perm* bits nobody else may hold
}

var permNames = [permBits]string{"consistent read", "write", "write unchanged", "resize"}

// lockImage takes l's lock bytes on f and checks that no other open file
// description holds a permission l does not share, or refuses to share
// one l holds; either way the image is in use and the open fails. OFD
// locks belong to this open file and go away when it is closed.
func lockImage(f *os.File, l Lock) error {
	fd := int(f.Fd())
	for i := int64(0); i < permBits; i++ {
		for base, on := range map[int64]bool{lockPermBase: l.Perm&(1<<i) != 0, lockSharedBase: l.Unshared&(1<<i) != 0} {
			if !on {
				continue
			}
			lk := unix.Flock_t{Type: unix.F_RDLCK, Start: base + i, Len: 1}
			if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_SETLK, &lk); err != nil {
				if err == unix.EINVAL || err == unix.ENOLCK || err == unix.EOPNOTSUPP {
					return nil // a file system without OFD locks: nothing to coordinate with
				}
				return fmt.Errorf("%s: lock byte %d: %w", f.Name(), base+i, err)
			}
		}
	}
	// QEMU's order (raw_check_lock_bytes): every permission we hold that
	// someone refuses to share, then every one we refuse that someone
	// holds; the first conflict is the one reported.
	for i := 0; i < permBits; i++ {
		if l.Perm&(1<<i) != 0 && lockedByOther(fd, lockSharedBase+int64(i)) {
			return &LockError{File: f.Name(), Perm: permNames[i]}
		}
	}
	for i := 0; i < permBits; i++ {
		if l.Unshared&(1<<i) != 0 && lockedByOther(fd, lockPermBase+int64(i)) {
			return &LockError{File: f.Name(), Perm: permNames[i], Shared: true}
		}
	}
	return nil
}

// LockError is an image lock refused (it is ErrInUse): another process
// does not share Perm, which this open holds, or (Shared) holds Perm,
// which this open does not share. QEMU words them "Failed to get
// \"write\" lock" and "Failed to get shared \"write\" lock".
type LockError struct {
	File   string
	Perm   string // QEMU's name: "consistent read", "write", "write unchanged", "resize"
	Shared bool
}

func (e *LockError) Error() string {
	if e.Shared {
		return fmt.Sprintf("%s: %v: another process holds its %s permission (is a VM, a qemu tool or another export using it?)", e.File, ErrInUse, e.Perm)
	}
	return fmt.Sprintf("%s: %v: another process does not share its %s permission (is a VM, a qemu tool or another export using it?)", e.File, ErrInUse, e.Perm)
}

func (e *LockError) Unwrap() error { return ErrInUse }

// lockedByOther says whether another open file description holds a lock
// on byte off (ours never conflict with themselves).
func lockedByOther(fd int, off int64) bool {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Start: off, Len: 1}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &lk); err != nil {
		return false
	}
	return lk.Type != unix.F_UNLCK
}
