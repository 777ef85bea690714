package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/filters/partition"
	"github.com/blockexport/blockexport/formats/registry"
)

// partitionFlags choose the disk's partitions to serve: --partitions adds
// each as a file (fuse, beside --file-name's) or an export name (nbd);
// --partition N serves partition N alone in the disk's place. The table
// is read from the opened image, so this works over every format.
type partitionFlags struct {
	all bool
	one int
}

func (p *partitionFlags) register(c *cobra.Command, all string) {
	fs := c.Flags()
	fs.BoolVar(&p.all, "partitions", false, all)
	fs.IntVar(&p.one, "partition", 0, "serve partition N of the image's MBR or GPT alone, in the image's place (N as Linux numbers it: MBR logical partitions from 5)")
}

func (p *partitionFlags) check(c *cobra.Command) error {
	if c.Flags().Changed("partition") && p.one < 1 {
		return usagef("--partition %d: partitions are numbered from 1", p.one)
	}
	if p.all && p.one > 0 {
		return usagef("--partitions and --partition %d: choose one", p.one)
	}
	return nil
}

// servedPartition is one partition served beside the disk.
type servedPartition struct {
	name string
	img  formats.Image
}

// apply reads the table when the flags ask for partitions. With
// --partition N it returns that partition's range in the disk's place;
// with --partitions the disk stays and each partition comes back named
// prefix+"p"+N. An image with no table, or a table that does not check
// out, is refused with one line.
func (p *partitionFlags) apply(ctx context.Context, disk formats.Image, spec, prefix string, log *slog.Logger) (formats.Image, []servedPartition, error) {
	if !p.all && p.one == 0 {
		return disk, nil, nil
	}
	tab, err := partition.Parse(ctx, disk)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", registry.Shown(spec), err)
	}
	if tab.BackupUsed {
		log.Warn("the primary GPT is damaged; the partitions are those of the backup GPT at the end of the disk, as the kernel and parted read them", "image", registry.Shown(spec))
	}
	if p.one > 0 {
		part, err := tab.Find(p.one)
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", registry.Shown(spec), err)
		}
		r, err := partition.NewRange(disk, part.Start, part.Size, fmt.Sprintf("%d", part.Number))
		if err != nil {
			return nil, nil, err
		}
		log.Info("serving one partition", "partition", part.Number, "start", part.Start, "size", part.Size, "table", tab.Scheme)
		return r, nil, nil
	}
	var out []servedPartition
	for _, part := range tab.Partitions {
		name := fmt.Sprintf("%sp%d", prefix, part.Number)
		r, err := partition.NewRange(disk, part.Start, part.Size, name)
		if err != nil {
			return nil, nil, err
		}
		out = append(out, servedPartition{name: name, img: r})
	}
	log.Info("serving the partitions too", "table", tab.Scheme, "partitions", len(out))
	return partition.FixedDisk{Filter: formats.Filter{Image: disk}}, out, nil
}
