// Package wire holds the NBD protocol's numbers (the NBD project's
// doc/proto.md) that both ends here speak: the server (export/nbd) and the
// client (formats/nbd). go-nbd (pkg/protocol) defines the baseline ones;
// this package names the rest, once.
package wire

import "github.com/pojntfx/go-nbd/pkg/protocol"

// Handshake.
const (
	MagicOldstyle = protocol.NEGOTIATION_MAGIC_OLDSTYLE // "NBDMAGIC"
	MagicOption   = protocol.NEGOTIATION_MAGIC_OPTION   // "IHAVEOPT"
	MagicReply    = protocol.NEGOTIATION_MAGIC_REPLY

	HandshakeFixed    = protocol.NEGOTIATION_HANDSHAKE_FLAG_FIXED_NEWSTYLE
	HandshakeNoZeroes = uint16(1 << 1)

	ClientFixed    = uint32(1 << 0)
	ClientNoZeroes = uint32(1 << 1)
)

// Options (NBD_OPT_*).
const (
	OptExportName      = uint32(1)
	OptAbort           = protocol.NEGOTIATION_ID_OPTION_ABORT
	OptList            = protocol.NEGOTIATION_ID_OPTION_LIST
	OptStartTLS        = uint32(5)
	OptInfo            = protocol.NEGOTIATION_ID_OPTION_INFO
	OptGo              = protocol.NEGOTIATION_ID_OPTION_GO
	OptStructuredReply = uint32(8)
	OptListMetaContext = uint32(9)
	OptSetMetaContext  = uint32(10)
	// OptExtendedHeaders asks for 32-byte request and reply headers with
	// 64-bit lengths (the EXTENDED_HEADERS extension: the NBD project's
	// extension-ext-header branch of doc/proto.md).
	OptExtendedHeaders = uint32(11)
)

// Option replies (NBD_REP_*); errors have bit 31 set.
const (
	RepAck         = protocol.NEGOTIATION_TYPE_REPLY_ACK
	RepServer      = protocol.NEGOTIATION_TYPE_REPLY_SERVER
	RepInfo        = protocol.NEGOTIATION_TYPE_REPLY_INFO
	RepMetaContext = uint32(4)

	RepFlagError     = uint32(1 << 31)
	RepErrUnsup      = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNSUPPORTED
	RepErrPolicy     = uint32(2 | 1<<31)
	RepErrInvalid    = uint32(3 | 1<<31)
	RepErrPlatform   = uint32(4 | 1<<31)
	RepErrTLSReqd    = uint32(5 | 1<<31)
	RepErrUnknown    = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNKNOWN
	RepErrShutdown   = uint32(7 | 1<<31)
	RepErrBlockReqd  = uint32(8 | 1<<31)
	RepErrTooBig     = uint32(9 | 1<<31)
	RepErrExtHdrReqd = uint32(10 | 1<<31)
	InfoExport       = protocol.NEGOTIATION_TYPE_INFO_EXPORT
	InfoName         = protocol.NEGOTIATION_TYPE_INFO_NAME
	InfoDescription  = protocol.NEGOTIATION_TYPE_INFO_DESCRIPTION
	InfoBlockSize    = protocol.NEGOTIATION_TYPE_INFO_BLOCKSIZE
	BaseAllocation   = "base:allocation"
	MaxStringLen     = 4096 // names, descriptions, messages
	DefaultPort      = 10809
	DefaultMaxBlock  = 32 << 20 // the largest request a server must take when it says nothing
	DefaultPrefBlock = 4096
)

// Transmission flags (NBD_FLAG_*).
const (
	FlagHasFlags     = protocol.NEGOTIATION_REPLY_FLAGS_HAS_FLAGS
	FlagReadOnly     = uint16(1 << 1)
	FlagSendFlush    = uint16(1 << 2)
	FlagSendFUA      = uint16(1 << 3)
	FlagSendTrim     = uint16(1 << 5)
	FlagSendZeroes   = uint16(1 << 6)
	FlagSendDF       = uint16(1 << 7)
	FlagCanMultiConn = protocol.NEGOTIATION_REPLY_FLAGS_CAN_MULTI_CONN
	FlagSendCache    = uint16(1 << 10)
	FlagSendFastZero = uint16(1 << 11)
)

// Requests (NBD_CMD_*) and their flags.
const (
	MagicRequest = protocol.TRANSMISSION_MAGIC_REQUEST

	CmdRead        = protocol.TRANSMISSION_TYPE_REQUEST_READ
	CmdWrite       = protocol.TRANSMISSION_TYPE_REQUEST_WRITE
	CmdDisc        = protocol.TRANSMISSION_TYPE_REQUEST_DISC
	CmdFlush       = uint16(3)
	CmdTrim        = uint16(4)
	CmdCache       = uint16(5)
	CmdWriteZeroes = uint16(6)
	CmdBlockStatus = uint16(7)

	CmdFlagFUA      = uint16(1 << 0)
	CmdFlagNoHole   = uint16(1 << 1)
	CmdFlagDF       = uint16(1 << 2)
	CmdFlagReqOne   = uint16(1 << 3)
	CmdFlagFastZero = uint16(1 << 4)
	// CmdFlagPayloadLen: with extended headers, the length is the
	// payload's (a WRITE's data), not the range the command covers.
	CmdFlagPayloadLen = uint16(1 << 5)

	RequestSize = 28 // magic, flags, type, cookie, offset, length

	// With extended headers: the length is 64 bits.
	MagicExtendedRequest = uint32(0x21e41c71)
	ExtendedRequestSize  = 32
)

// Replies.
const (
	MagicSimple     = protocol.TRANSMISSION_MAGIC_REPLY
	MagicStructured = uint32(0x668e33ef)
	// MagicExtendedReply heads every reply once extended headers are
	// negotiated: flags, type, cookie, the request's offset, a 64-bit
	// length (32 bytes).
	MagicExtendedReply = uint32(0x6e8a278c)

	ChunkFlagDone = uint16(1 << 0)

	ChunkNone        = uint16(0)
	ChunkOffsetData  = uint16(1)
	ChunkOffsetHole  = uint16(2)
	ChunkBlockStatus = uint16(5)
	// ChunkBlockStatusExt: block status under extended headers (context,
	// descriptor count, then 64-bit lengths and status flags).
	ChunkBlockStatusExt = uint16(6)
	ChunkError          = uint16(1<<15 + 1)
	ChunkErrorOffset    = uint16(1<<15 + 2)

	SimpleReplySize     = 16 // magic, error, cookie
	StructuredReplySize = 20 // magic, flags, type, cookie, length
	ExtendedReplySize   = 32 // magic, flags, type, cookie, offset, length

	StateHole = uint32(1 << 0)
	StateZero = uint32(1 << 1)
)

// Errors a server sends (NBD_E*), errno values on Linux.
const (
	EPerm     = uint32(1)
	EIO       = uint32(5)
	ENoMem    = uint32(12)
	EInval    = uint32(22)
	ENoSpc    = uint32(28)
	EOverflow = uint32(75)
	ENotSup   = uint32(95)
	EShutdown = uint32(108)
)
