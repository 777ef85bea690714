package qcow2

import "testing"

// TestFullyAllocatedIsQemus: the fully allocated sizes qemu-img 7.2
// measure printed for these targets.
func TestFullyAllocatedIsQemus(t *testing.T) {
	for _, c := range []struct {
		t       MeasureTarget
		virtual int64
		want    int64
	}{
		{MeasureTarget{ClusterSize: 64 << 10, RefcountBits: 16}, 64 << 20, 67436544},
		{MeasureTarget{ClusterSize: 64 << 10, RefcountBits: 16}, 1 << 30, 1074135040},
		{MeasureTarget{ClusterSize: 4 << 10, RefcountBits: 16}, 64 << 20, 67289088},
		{MeasureTarget{ClusterSize: 2 << 20, RefcountBits: 1}, 64 << 20, 77594624},
		{MeasureTarget{ClusterSize: 64 << 10, RefcountBits: 16}, 64 << 30, 68730224640},
	} {
		if got := c.t.FullyAllocated(c.virtual); got != c.want {
			t.Errorf("%+v.FullyAllocated(%d) = %d, want %d", c.t, c.virtual, got, c.want)
		}
	}
	if err := (MeasureTarget{ClusterSize: 64 << 10, RefcountBits: 16}).CheckMeasureSize(1<<63 - 1); err == nil {
		t.Error("an L1 table past QEMU's limit was not refused")
	}
}
