// Package s3 is the remote.Backend for s3://BUCKET/KEY objects, in AWS S3
// or any store that speaks its API. Requests are signed by aws-sdk-go-v2,
// configured as the AWS tools are (environment, shared files; the endpoint
// from --s3-endpoint or AWS_ENDPOINT_URL(_S3)). An s3:// name says only a
// bucket and a key, so a backing string in an image never chooses an
// endpoint or credentials: those are always the user's own.
package s3

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsmiddleware "github.com/aws/aws-sdk-go-v2/aws/middleware"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/feature/ec2/imds"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/smithy-go"
	"github.com/aws/smithy-go/logging"
	smithyhttp "github.com/aws/smithy-go/transport/http"

	"github.com/blockexport/blockexport/formats/protocols/remote"
)

// defaultRegion is used when no region is configured anywhere: S3-compatible
// stores mostly ignore it, but SigV4 needs one to sign with.
const defaultRegion = "us-east-1"

// Options is the user's S3 configuration beyond what the SDK reads from the
// environment and the shared files.
type Options struct {
	// Endpoint overrides the SDK's endpoint resolution (--s3-endpoint),
	// e.g. http://127.0.0.1:7070 for a local store.
	Endpoint string
	// PathStyle asks for http://host/BUCKET/KEY rather than
	// http://BUCKET.host/KEY. It is chosen by itself for an endpoint whose
	// host is an IP address or localhost, where no bucket subdomain can
	// resolve.
	PathStyle bool
	// Connections bounds the kept-alive connections (at least 1).
	Connections int
	// CAFile, if set, is a PEM bundle that verifies the endpoint's TLS
	// certificate instead of the system roots.
	CAFile string
	// DialTimeout bounds one TCP connect; 0 means 10 s.
	DialTimeout time.Duration
	// dial, when set, replaces the transport's dialer (tests: an endpoint
	// whose name does not resolve, without a DNS lookup).
	dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

// Backend reads one object. It is safe for concurrent use.
type Backend struct {
	client *s3.Client
	http   aws.HTTPClient
	bucket string
	key    string
	name   string
	// awsEndpoint: no endpoint was given, the SDK chose AWS's.
	awsEndpoint bool
}

// ErrBadURL marks a name that is not a usable s3://BUCKET/KEY.
var ErrBadURL = errors.New("bad s3 URL")

// IsURL says whether spec is meant as an s3:// name (checked or not).
func IsURL(spec string) bool { return strings.HasPrefix(spec, "s3://") }

// ParseURL splits s3://BUCKET/KEY. The key is taken literally (as the AWS
// CLI takes it), the bucket must be a plausible bucket name, so that no
// user@host or host:port can pass for one.
func ParseURL(raw string) (bucket, key string, err error) {
	rest, ok := strings.CutPrefix(raw, "s3://")
	if !ok {
		return "", "", fmt.Errorf("%w: not an s3://BUCKET/KEY name", ErrBadURL)
	}
	bucket, key, ok = strings.Cut(rest, "/")
	if !ok || key == "" {
		return "", "", fmt.Errorf("%w: %q names no object: want s3://BUCKET/KEY", ErrBadURL, raw)
	}
	if err := checkBucket(bucket); err != nil {
		// Not quoted: what stands where the bucket should may be a
		// user:password@host typed by mistake.
		return "", "", fmt.Errorf("%w: %w", ErrBadURL, err)
	}
	if len(key) > 1024 {
		return "", "", fmt.Errorf("%w: s3://%s/…: key of %d bytes is longer than S3's 1024", ErrBadURL, bucket, len(key))
	}
	for _, c := range []byte(key) {
		if c < 0x20 || c == 0x7f {
			return "", "", fmt.Errorf("%w: s3://%s/…: key has a control character", ErrBadURL, bucket)
		}
	}
	return bucket, key, nil
}

// checkBucket accepts S3's bucket names (and the upper case and underscores
// that legacy buckets and some stores allow), nothing that could read as a
// host, a port or user information.
func checkBucket(b string) error {
	if len(b) < 3 || len(b) > 63 {
		return fmt.Errorf("s3://BUCKET/KEY: the bucket name is %d characters, not 3 to 63", len(b))
	}
	for i := 0; i < len(b); i++ {
		c := b[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case c == '-' || c == '.' || c == '_':
		default:
			return fmt.Errorf("s3://BUCKET/KEY: the bucket has a character a bucket name cannot have (%q)", c)
		}
	}
	return nil
}

// New builds the backend for rawURL (s3://BUCKET/KEY). It loads the SDK's
// configuration but sends nothing; Stat is the first request.
func New(ctx context.Context, rawURL string, opts Options) (*Backend, error) {
	bucket, key, err := ParseURL(rawURL)
	if err != nil {
		return nil, err
	}
	name := "s3://" + bucket + "/" + key
	conns := max(opts.Connections, 1)
	dial := opts.DialTimeout
	if dial <= 0 {
		dial = 10 * time.Second
	}
	var roots *x509.CertPool
	if opts.CAFile != "" {
		pem, err := os.ReadFile(opts.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%s: reading the CA bundle: %w", name, err)
		}
		roots = x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s: %s holds no PEM certificate", name, opts.CAFile)
		}
	}
	hc := awshttp.NewBuildableClient().
		WithDialerOptions(func(d *net.Dialer) { d.Timeout = dial }).
		WithTransportOptions(func(tr *http.Transport) {
			// One kept-alive connection per concurrent reader the shared
			// layer runs; more idle ones would only be closed later.
			tr.MaxIdleConns = conns
			tr.MaxIdleConnsPerHost = conns
			// An image is not compressible enough to be worth it, and
			// a transparently inflated body would have a length that
			// does not match the range asked.
			tr.DisableCompression = true
			if opts.dial != nil {
				tr.DialContext = opts.dial
			}
		})
	cfg, err := config.LoadDefaultConfig(ctx,
		config.WithHTTPClient(hc),
		// The shared layer retries with backoff up to --reconnect-timeout;
		// the SDK's own retryer would retry inside each attempt and make
		// that deadline a multiple of itself.
		config.WithRetryer(func() aws.Retryer { return aws.NopRetryer{} }),
		config.WithRetryMaxAttempts(1),
		// The whole-object checksums S3 keeps do not cover a range.
		config.WithResponseChecksumValidation(aws.ResponseChecksumValidationWhenRequired),
		config.WithRequestChecksumCalculation(aws.RequestChecksumCalculationWhenRequired),
		// Credentials come from the environment and the shared files
		// only: the EC2 instance metadata service, the SDK's last
		// resort, is a network address the user never named.
		config.WithEC2IMDSClientEnableState(imds.ClientDisabled),
		// What goes wrong is said in the error, not in SDK log lines.
		config.WithLogger(logging.Nop{}),
	)
	if err != nil {
		// The SDK's message names the file or variable at fault, never
		// a secret.
		return nil, fmt.Errorf("%s: loading the AWS configuration: %w", name, err)
	}
	cfg.Region = cmp.Or(cfg.Region, defaultRegion)
	// The SDK has applied AWS_CA_BUNDLE (or ca_bundle in the shared
	// config) to a copy of hc by now; --tls-ca, given on the command
	// line, wins over both. Then the client is frozen, so that the one
	// Close drops the connections of is the one requests use.
	if bc, ok := cfg.HTTPClient.(*awshttp.BuildableClient); ok {
		if roots != nil {
			bc = bc.WithTransportOptions(func(tr *http.Transport) {
				if tr.TLSClientConfig == nil {
					tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12}
				}
				tr.TLSClientConfig.RootCAs = roots
			})
		}
		cfg.HTTPClient = bc.Freeze()
	}
	var endpointErr error
	client := s3.NewFromConfig(cfg, func(o *s3.Options) {
		o.Retryer = aws.NopRetryer{}
		o.RetryMaxAttempts = 1
		o.DisableLogOutputChecksumValidationSkipped = true
		if opts.Endpoint != "" {
			ep := opts.Endpoint
			o.BaseEndpoint = &ep
		}
		o.UsePathStyle = opts.PathStyle
		if o.BaseEndpoint != nil {
			// o.BaseEndpoint is here whichever way it was given: the
			// flag, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or the
			// shared config file.
			local, err := localEndpoint(*o.BaseEndpoint)
			if err != nil {
				endpointErr = err
				return
			}
			if local {
				o.UsePathStyle = true
			}
		}
	})
	if endpointErr != nil {
		return nil, fmt.Errorf("%s: %w", name, endpointErr)
	}
	return &Backend{client: client, http: cfg.HTTPClient, bucket: bucket, key: key, name: name,
		awsEndpoint: client.Options().BaseEndpoint == nil}, nil
}

// localEndpoint says whether an endpoint's host is an IP address or
// localhost, where a virtual-hosted bucket name cannot resolve.
func localEndpoint(ep string) (bool, error) {
	u, err := url.Parse(ep)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return false, fmt.Errorf("S3 endpoint %q is not an http:// or https:// URL", remote.Redact(ep))
	}
	if u.User != nil {
		return false, fmt.Errorf("S3 endpoint %q has user information: give credentials the AWS way (environment or shared files)", remote.Redact(ep))
	}
	h := u.Hostname()
	return h == "localhost" || strings.HasSuffix(h, ".localhost") || net.ParseIP(h) != nil, nil
}

// String names the object: s3://BUCKET/KEY, never an endpoint's secret or
// a credential.
func (b *Backend) String() string { return b.name }

// Close drops the kept-alive connections.
func (b *Backend) Close() error {
	if c, ok := b.http.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
	return nil
}

// Stat pins the object's size and identity with a HeadObject. A 403 or 404
// is explained in one line: which of the credentials, the bucket or the key
// is wrong (a HEAD reply has no body to say, so a one-byte GET asks).
func (b *Backend) Stat(ctx context.Context) (remote.Object, error) {
	out, err := b.client.HeadObject(ctx, &s3.HeadObjectInput{Bucket: &b.bucket, Key: &b.key})
	if err != nil {
		return remote.Object{}, b.openError(ctx, err)
	}
	if out.ContentLength == nil || *out.ContentLength < 0 {
		return remote.Object{}, fmt.Errorf("%s: the server gave no object size", b.name)
	}
	if *out.ContentLength > remote.MaxSize {
		return remote.Object{}, fmt.Errorf("%s: the server says the object is %d bytes, over the %d served", b.name, *out.ContentLength, int64(remote.MaxSize))
	}
	obj := remote.Object{Size: *out.ContentLength, ETag: aws.ToString(out.ETag), LastModified: aws.ToTime(out.LastModified)}
	if obj.ETag == "" && obj.LastModified.IsZero() {
		// Without either, nothing would tell a replaced object from the
		// one opened: a mix of two versions could be served.
		return remote.Object{}, fmt.Errorf("%s: the server gave neither an ETag nor a Last-Modified, so a replaced object could not be detected", b.name)
	}
	return obj, nil
}

// openError turns a failed HeadObject into one line.
func (b *Backend) openError(ctx context.Context, err error) error {
	if credentialsError(err) && strings.Contains(err.Error(), "EC2 IMDS") {
		// The SDK's chain ran out at its last resort, which New turns
		// off: nothing is configured (else the SDK's message says what failed).
		return fmt.Errorf("%s: no credentials found (looked in %s)", b.name, credentialPlaces())
	}
	var dnsErr *net.DNSError
	if b.awsEndpoint && errors.As(err, &dnsErr) {
		return fmt.Errorf("%s: no endpoint given, and AWS S3's does not resolve (%v): for another S3-compatible store, pass --s3-endpoint URL (or set AWS_ENDPOINT_URL_S3)", b.name, dnsErr)
	}
	if e := classify(err); errors.Is(e, remote.ErrTemporary) {
		return fmt.Errorf("%s: %w", b.name, e)
	}
	status := httpStatus(err)
	code := apiCode(err)
	if status == http.StatusForbidden || status == http.StatusNotFound || status == http.StatusBadRequest || status == http.StatusMovedPermanently || code == "NotFound" || code == "Forbidden" {
		// The HEAD reply had no body; a GET of one byte gets the code.
		r := "bytes=0-0"
		if _, gerr := b.client.GetObject(ctx, &s3.GetObjectInput{Bucket: &b.bucket, Key: &b.key, Range: &r}); apiCode(gerr) != "" {
			code, status = apiCode(gerr), httpStatus(gerr)
		}
	}
	var why string
	switch code {
	case "NoSuchBucket":
		why = "no such bucket"
	case "NoSuchKey", "NotFound":
		why = "no such object"
	case "InvalidAccessKeyId", "XAdminUserNotFound": // versitygw's word for it, with a 404
		why = "the access key is not known to the server (InvalidAccessKeyId): check AWS_ACCESS_KEY_ID, AWS_PROFILE or the shared credentials file"
	case "SignatureDoesNotMatch":
		why = "the server refused the request signature (SignatureDoesNotMatch): check the secret key"
	case "AccessDenied", "Forbidden", "AllAccessDisabled":
		why = "access denied (" + code + "): check the credentials and the bucket's policy"
	case "ExpiredToken", "InvalidToken", "TokenRefreshRequired":
		why = "the session token is expired or invalid (" + code + ")"
	case "PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException":
		why = "the bucket is in another region (" + code + "): set AWS_REGION"
	case "":
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("%s: %w", b.name, err)
		}
		if status != 0 {
			why = "the server answered HTTP " + strconv.Itoa(status)
		} else {
			why = sdkMessage(err)
		}
	default:
		if status == http.StatusForbidden {
			// Stores name an unknown key in their own words
			// (versitygw: XAdminUserNotFound).
			why = "access refused (" + code + "): check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE, the shared credentials file) and the bucket's policy"
		} else {
			why = "the server refused (" + code + ")"
		}
	}
	return fmt.Errorf("%s: %s", b.name, why)
}

// credentialsError says whether the SDK failed before sending anything
// because no credentials could be found.
func credentialsError(err error) bool {
	return strings.Contains(err.Error(), "failed to retrieve credentials") ||
		strings.Contains(err.Error(), "failed to refresh cached credentials")
}

// credentialPlaces says where the SDK's configuration, as New builds it,
// looks for credentials.
func credentialPlaces() string {
	return fmt.Sprintf("AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, then profile %q (AWS_PROFILE) in %s and %s; "+
		"the EC2 instance metadata service is never asked",
		cmp.Or(os.Getenv("AWS_PROFILE"), os.Getenv("AWS_DEFAULT_PROFILE"), "default"),
		cmp.Or(os.Getenv("AWS_SHARED_CREDENTIALS_FILE"), config.DefaultSharedCredentialsFilename()),
		cmp.Or(os.Getenv("AWS_CONFIG_FILE"), config.DefaultSharedConfigFilename()))
}

// sdkMessage is the innermost error's text, without the SDK's operation
// prefix.
func sdkMessage(err error) string {
	var oe *smithy.OperationError
	if errors.As(err, &oe) && oe.Err != nil {
		return oe.Err.Error()
	}
	return err.Error()
}

func httpStatus(err error) int {
	var re *smithyhttp.ResponseError
	if errors.As(err, &re) && re.Response != nil {
		return re.Response.StatusCode
	}
	return 0
}

func apiCode(err error) string {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		return ae.ErrorCode()
	}
	return ""
}

// retryable is the SDK's own judgement of what is worth retrying
// (connection resets, timeouts, 5xx, throttling), which its retryer would
// have used: the shared layer does the retrying instead.
var retryable = retry.IsErrorRetryables(append([]retry.IsErrorRetryable{
	retry.RetryableHTTPStatusCode{Codes: map[int]struct{}{429: {}, 500: {}, 502: {}, 503: {}, 504: {}}},
}, retry.DefaultRetryables...))

// classify maps a request's error to the Backend contract: 412 is
// ErrChanged, what a retry may cure is Temporary, the rest stays as it is.
func classify(err error) error {
	// No credentials anywhere is the user's configuration, not the
	// network: retrying only delays the line that says so.
	if err == nil || errors.Is(err, context.Canceled) || credentialsError(err) {
		return err
	}
	if httpStatus(err) == http.StatusPreconditionFailed || apiCode(err) == "PreconditionFailed" {
		return remote.ErrChanged
	}
	var ne net.Error
	var oe *net.OpError // refused, reset, unreachable: a server restarting
	if s := httpStatus(err); s >= 500 && s <= 599 || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, io.ErrUnexpectedEOF) ||
		retryable.IsErrorRetryable(err) == aws.TrueTernary || errors.As(err, &ne) && ne.Timeout() || errors.As(err, &oe) {
		return remote.Temporary(err)
	}
	return err

}

// ReadRange fetches exactly [off, off+len(p)) of the version obj names:
// GetObject with Range and If-Match (If-Unmodified-Since where there is no
// ETag), and every claim of the reply is checked before a byte is trusted.
func (b *Backend) ReadRange(ctx context.Context, obj remote.Object, p []byte, off int64) error {
	return b.ReadRangev(ctx, obj, [][]byte{p}, off)
}

// ReadRangev is ReadRange of bufs' concatenation: one GET, its body read
// straight into each of bufs in turn.
func (b *Backend) ReadRangev(ctx context.Context, obj remote.Object, bufs [][]byte, off int64) error {
	total := 0
	for _, d := range bufs {
		total += len(d)
	}
	if total == 0 {
		return nil
	}
	end := off + int64(total) - 1
	if off < 0 || end < off || end >= obj.Size {
		return fmt.Errorf("%s: range %d+%d outside the object's %d bytes", b.name, off, total, obj.Size)
	}
	rng := "bytes=" + strconv.FormatInt(off, 10) + "-" + strconv.FormatInt(end, 10)
	in := &s3.GetObjectInput{Bucket: &b.bucket, Key: &b.key, Range: &rng}
	if obj.ETag != "" {
		etag := obj.ETag
		in.IfMatch = &etag
	} else {
		// A second past the pinned time: HTTP dates have a second's
		// resolution and some servers (versitygw 1.8.0) refuse a time
		// equal to the object's; the reply's own Last-Modified is compared
		// with the pinned one (checkReply), so a replacement in that second
		// is still caught.
		lm := obj.LastModified.Add(time.Second)
		in.IfUnmodifiedSince = &lm
	}
	out, err := b.client.GetObject(ctx, in)
	if err != nil {
		if e := classify(err); errors.Is(e, remote.ErrChanged) {
			return fmt.Errorf("%s: %w", b.name, e)
		} else {
			return fmt.Errorf("%s: reading %d bytes at %d: %w", b.name, total, off, e)
		}
	}
	defer out.Body.Close()
	if err := b.checkReply(out, obj, off, total); err != nil {
		return err
	}
	for _, d := range bufs {
		if _, err := io.ReadFull(out.Body, d); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			// A body cut short is a dropped connection more often than a
			// lie; the length was checked above, so a retry is worth it.
			return fmt.Errorf("%s: reading %d bytes at %d: body ended early: %w", b.name, total, off, remote.Temporary(err))
		}
	}
	// Read on to the body's end (the length was checked: it is there
	// already): a body closed before its end is seen may close its
	// connection rather than keep it for the next GET, and a byte more
	// is a reply that lies.
	var extra [1]byte
	if k, _ := out.Body.Read(extra[:]); k != 0 {
		return fmt.Errorf("%s: reading %d bytes at %d: the body is longer than its Content-Length", b.name, total, off)
	}
	return nil
}

// checkReply refuses a reply that is not the asked range of the pinned
// version: a 200 with the whole object, a 206 for another range or another
// size or with an unknown ("*") size, a length that does not match,
// another ETag (a server that ignored If-Match).
func (b *Backend) checkReply(out *s3.GetObjectOutput, obj remote.Object, off int64, n int) error {
	if raw, ok := awsmiddleware.GetRawResponse(out.ResultMetadata).(*smithyhttp.Response); ok && raw != nil {
		if raw.StatusCode != http.StatusPartialContent {
			return fmt.Errorf("%s: asked for %d bytes at %d, the server answered HTTP %d instead of 206", b.name, n, off, raw.StatusCode)
		}
	}
	if out.ContentRange == nil || out.ContentLength == nil || *out.ContentLength < 0 {
		return fmt.Errorf("%s: asked for %d bytes at %d, the reply lacks a Content-Range or a Content-Length", b.name, n, off)
	}
	if strings.HasSuffix(*out.ContentRange, "/*") {
		// The size was pinned at open: a reply must restate it.
		return fmt.Errorf("%s: %w: Content-Range %q: no total", b.name, remote.ErrBadReply, *out.ContentRange)
	}
	if err := remote.CheckPartial(*out.ContentRange, *out.ContentLength, off, int64(n), obj.Size); err != nil {
		return fmt.Errorf("%s: asked for %d bytes at %d: %w", b.name, n, off, err)
	}
	if obj.ETag != "" && out.ETag != nil && *out.ETag != obj.ETag {
		return fmt.Errorf("%s: %w (ETag %s at open, %s now)", b.name, remote.ErrChanged, obj.ETag, *out.ETag)
	}
	if obj.ETag == "" && (out.LastModified == nil || !out.LastModified.Equal(obj.LastModified)) {
		got := "none"
		if out.LastModified != nil {
			got = out.LastModified.UTC().Format(http.TimeFormat)
		}
		return fmt.Errorf("%s: %w (Last-Modified %s at open, %s now)", b.name, remote.ErrChanged, obj.LastModified.UTC().Format(http.TimeFormat), got)
	}
	return nil
}

var _ remote.VectorBackend = (*Backend)(nil)
