package raw

import "unsafe"

func alignedAddr(p []byte, align int) bool {
	return uintptr(unsafe.Pointer(&p[0]))&uintptr(align-1) == 0
}
