package lru

import "testing"

func TestCache(t *testing.T) {
	c := New[string](2)
	c.Put(1, "a")
	c.Put(2, "b")
	if v, ok := c.Get(1); !ok || v != "a" { // 1 is now the most recent
		t.Fatalf("Get(1) = %q, %v", v, ok)
	}
	c.Put(3, "c") // drops 2, the least recently used
	if c.Len() != 2 || c.Cap() != 2 {
		t.Fatalf("Len %d, Cap %d; want 2 and 2", c.Len(), c.Cap())
	}
	if _, ok := c.Get(2); ok {
		t.Fatal("2 kept past the capacity")
	}
	for k, want := range map[int64]string{1: "a", 3: "c"} {
		if v, ok := c.Get(k); !ok || v != want {
			t.Fatalf("Get(%d) = %q, %v; want %q", k, v, ok, want)
		}
	}
	c.Put(1, "a2") // replaces
	if v, _ := c.Get(1); v != "a2" {
		t.Fatalf("Put did not replace: %q", v)
	}
	c.Remove(1)
	c.Remove(99) // absent: nothing
	if _, ok := c.Get(1); ok {
		t.Fatal("Remove left the value")
	}

	// PutIfGen: not over a cached value, not across a Bump.
	g := c.Gen()
	c.PutIfGen(3, "stale", g)
	if v, _ := c.Get(3); v != "c" {
		t.Fatalf("PutIfGen replaced a cached value: %q", v)
	}
	c.Bump()
	c.PutIfGen(4, "loaded before the bump", g)
	if _, ok := c.Get(4); ok {
		t.Fatal("PutIfGen cached a value of an older generation")
	}
	c.PutIfGen(4, "d", c.Gen())
	if v, ok := c.Get(4); !ok || v != "d" {
		t.Fatalf("PutIfGen of the current generation: %q, %v", v, ok)
	}

	if z := New[int](0); z.cap != 1 {
		t.Fatalf("capacity 0 made %d, want 1", z.cap)
	}
}
