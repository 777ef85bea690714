package fuse

import "testing"

// TestCountCPUs: the kernel's CPU lists, and what is not one.
func TestCountCPUs(t *testing.T) {
	for list, want := range map[string]int{"0": 1, "0-1\n": 2, "0-3,8-11": 8, "0,2,4": 3} {
		if n, err := countCPUs(list); err != nil || n != want {
			t.Errorf("%q: %d, %v; want %d", list, n, err, want)
		}
	}
	for _, bad := range []string{"", "x", "3-1", "0-", "-1", "0,,1"} {
		if n, err := countCPUs(bad); err == nil {
			t.Errorf("%q: %d, accepted", bad, n)
		}
	}
}
