package vmdk

import (
	"container/list"
	"sync"
)

// lru is a small mutex-guarded LRU cache keyed by sector: grain tables and
// decompressed grains. Entries are never changed once cached (the image
// is read-only), so two goroutines loading one key may both put it.
type lru[V any] struct {
	mu    sync.Mutex
	cap   int
	order *list.List // front = most recently used
	items map[int64]*list.Element
}

type lruItem[V any] struct {
	key int64
	val V
}

func newLRU[V any](capacity int) *lru[V] {
	return &lru[V]{cap: max(capacity, 1), order: list.New(), items: map[int64]*list.Element{}}
}

func (c *lru[V]) get(key int64) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.order.MoveToFront(e)
		return e.Value.(*lruItem[V]).val, true
	}
	var zero V
	return zero, false
}

func (c *lru[V]) put(key int64, val V) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.order.MoveToFront(e)
		return
	}
	c.items[key] = c.order.PushFront(&lruItem[V]{key, val})
	for c.order.Len() > c.cap {
		last := c.order.Back()
		c.order.Remove(last)
		delete(c.items, last.Value.(*lruItem[V]).key)
	}
}
