package commit

import (
	"os"
	"path/filepath"
)

// NamesFile says whether name, a layer's name as the image at image
// records it (relative to its directory), is the file at path.
func NamesFile(image, name, path string) bool {
	if !filepath.IsAbs(name) {
		name = filepath.Join(filepath.Dir(image), name)
	}
	return SameFile(name, path)
}

// SameFile says whether a and b are one file (links and other spellings
// of a path included).
func SameFile(a, b string) bool {
	sa, err := os.Stat(a)
	if err != nil {
		return false
	}
	sb, err := os.Stat(b)
	return err == nil && os.SameFile(sa, sb)
}
