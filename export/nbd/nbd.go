// Package nbd serves one image over the NBD protocol (fixed newstyle), as
// qemu-nbd and qemu-storage-daemon's NBD export do.
//
// What comes from github.com/pojntfx/go-nbd (pkg/protocol): the magic
// numbers, the option, option-reply, request and simple-reply headers and
// the INFO structs, with their field layouts. What is written here, because
// go-nbd's server only speaks the baseline (serial READ/WRITE/DISC, a
// backend error drops the connection): NBD_OPT_EXPORT_NAME,
// STRUCTURED_REPLY, LIST/SET_META_CONTEXT (base:allocation), the commands
// FLUSH, TRIM, WRITE_ZEROES (NO_HOLE, FAST_ZERO), BLOCK_STATUS, CACHE and
// FUA, structured replies, truthful transmission flags, and parallel
// processing: each request of a connection runs in its own goroutine and is
// answered when it completes, so replies may come out of order. Requests
// the image finishes without waiting (its TryReadAt and TryWriteAt: null,
// page-cache hits, qcow2 writes in place) are answered inline by the
// connection's reader, and a lone one runs there blocking; the FUSE server
// makes the same decision with the same helper (coroutines.Handoff). The
// reader serves its socket with plain syscalls rather than the netpoller
// (sock_linux.go). A client that goes away cancels its requests' context,
// which aio passes on to the ring. Reads send runs of zeroes as
// OFFSET_HOLE chunks.
package nbd

import (
	"github.com/pojntfx/go-nbd/pkg/protocol"
)

// Protocol values go-nbd does not define (doc/proto.md of the NBD project).
const (
	handshakeFlagNoZeroes = uint16(1 << 1)
	clientFlagFixed       = uint32(1 << 0)
	clientFlagNoZeroes    = uint32(1 << 1)

	optExportName      = uint32(1)
	optStartTLS        = uint32(5)
	optStructuredReply = uint32(8)
	optListMetaContext = uint32(9)
	optSetMetaContext  = uint32(10)

	repMetaContext = uint32(4)
	repErrPolicy   = uint32(2 | 1<<31)
	repErrInvalid  = uint32(3 | 1<<31)
	repErrTooBig   = uint32(9 | 1<<31)

	flagReadOnly        = uint16(1 << 1)
	flagSendFlush       = uint16(1 << 2)
	flagSendFUA         = uint16(1 << 3)
	flagSendTrim        = uint16(1 << 5)
	flagSendWriteZeroes = uint16(1 << 6)
	flagSendDF          = uint16(1 << 7)
	flagSendCache       = uint16(1 << 10)
	flagSendFastZero    = uint16(1 << 11)

	cmdFlush       = uint16(3)
	cmdTrim        = uint16(4)
	cmdCache       = uint16(5)
	cmdWriteZeroes = uint16(6)
	cmdBlockStatus = uint16(7)

	cmdFlagFUA      = uint16(1 << 0)
	cmdFlagNoHole   = uint16(1 << 1)
	cmdFlagDF       = uint16(1 << 2)
	cmdFlagReqOne   = uint16(1 << 3)
	cmdFlagFastZero = uint16(1 << 4)

	structuredReplyMagic = uint32(0x668e33ef)
	chunkFlagDone        = uint16(1 << 0)
	chunkOffsetData      = uint16(1)
	chunkOffsetHole      = uint16(2)
	chunkBlockStatus     = uint16(5)
	chunkError           = uint16(1<<15 + 1)

	stateHole = uint32(1 << 0)
	stateZero = uint32(1 << 1)

	errPerm      = uint32(1)
	errIO        = uint32(5)
	errNoMem     = uint32(12)
	errInval     = uint32(22)
	errNoSpc     = uint32(28)
	errOverflow  = uint32(75)
	errNotSup    = uint32(95)
	errShutdown  = uint32(108)
	baseAllocID  = uint32(1)
	baseAllocCtx = "base:allocation"

	// Block size constraints we advertise: any byte alignment works, 4 KiB
	// is best, and 32 MiB is the largest request.
	minBlock       = 1
	preferredBlock = 4096
	maxRequest     = 32 << 20
	// maxOptionLen bounds an option's payload (names are at most 4 KiB).
	maxOptionLen = 64 << 10
)

// Aliases so the rest of the package reads in NBD's own words.
const (
	magicOldstyle  = protocol.NEGOTIATION_MAGIC_OLDSTYLE
	magicOption    = protocol.NEGOTIATION_MAGIC_OPTION
	magicReply     = protocol.NEGOTIATION_MAGIC_REPLY
	magicRequest   = protocol.TRANSMISSION_MAGIC_REQUEST
	magicSimple    = protocol.TRANSMISSION_MAGIC_REPLY
	handshakeFixed = protocol.NEGOTIATION_HANDSHAKE_FLAG_FIXED_NEWSTYLE
	optAbort       = protocol.NEGOTIATION_ID_OPTION_ABORT
	optList        = protocol.NEGOTIATION_ID_OPTION_LIST
	optInfo        = protocol.NEGOTIATION_ID_OPTION_INFO
	optGo          = protocol.NEGOTIATION_ID_OPTION_GO
	repAck         = protocol.NEGOTIATION_TYPE_REPLY_ACK
	repServer      = protocol.NEGOTIATION_TYPE_REPLY_SERVER
	repInfo        = protocol.NEGOTIATION_TYPE_REPLY_INFO
	repErrUnsup    = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNSUPPORTED
	repErrUnknown  = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNKNOWN
	infoExport     = protocol.NEGOTIATION_TYPE_INFO_EXPORT
	infoName       = protocol.NEGOTIATION_TYPE_INFO_NAME
	infoDesc       = protocol.NEGOTIATION_TYPE_INFO_DESCRIPTION
	infoBlockSize  = protocol.NEGOTIATION_TYPE_INFO_BLOCKSIZE
	flagHasFlags   = protocol.NEGOTIATION_REPLY_FLAGS_HAS_FLAGS
	flagMultiConn  = protocol.NEGOTIATION_REPLY_FLAGS_CAN_MULTI_CONN
	cmdRead        = protocol.TRANSMISSION_TYPE_REQUEST_READ
	cmdWrite       = protocol.TRANSMISSION_TYPE_REQUEST_WRITE
	cmdDisc        = protocol.TRANSMISSION_TYPE_REQUEST_DISC
)
