// Command grpc_client is a tiny grpc-go client for dracpu's tests: the kubelet's own gRPC stack
// playing the kubelet against our server (tests/adapters/test_grpc_server_grpcgo.py).
//
// Usage: grpc_client unix:///path/to/socket
//
//	or: grpc_client /path/to/socket
//
// Both are ways the kubelet dials its plugins (insecure): a "unix://" target (its newer DRA
// client), or a bare path with a unix dialer of its own (its plugin watcher, which calls the
// registration socket, and its older DRA client).
//
// Each line of stdin is a batch: a JSON list of calls.
//
//	[{"method": "/pkg.Service/Method", "request": "<hex>", "timeout_ms": 10000, "copies": 1,
//	  "max_recv": 0, "wait_for_ready": false, "metadata": {"key": "value"}, "messages": 0}, ...]
//
// The calls of a batch start together, each as "copies" concurrent invocations of the same
// request; the next batch is read once the batch has ended. Every call of every batch goes over
// ONE ClientConn, so batches are sequential calls on one kept connection (which grpc-go dials
// again by itself if the server goes away, as the kubelet's does).
// "max_recv" raises grpc-go's receive limit (0: its default, 4 MiB); "wait_for_ready" makes a
// call wait for a connection instead of failing fast; "metadata" adds request headers. Messages
// are raw bytes: the codec passes them through untouched, and it is registered as grpc-go's
// default codec ("proto"), so the content-type is "application/grpc", as the kubelet sends it
// (grpc-go sends "application/grpc+<name>" for a codec given with ForceCodec). "messages" > 0 makes the call server-streaming, as the kubelet's device
// health watch (NodeWatchResources): the request is sent, the client half-closes, and up to
// that many replies are read; then the client cancels the call, unless the server ended it
// first.
//
// When a batch has ended, stdout gets one JSON line per invocation, in input order (copies in
// order within a call), with the grpc-go status of the call (0 and "" on success):
//
//	{"call": 0, "copy": 0, "reply": "<hex>", "code": 0, "message": "", "elapsed_ms": 1.2}
//
// A streaming call has "replies" (hex, in order) instead of "reply", and "ended": true when
// the server ended the stream (its status in "code" and "message"; 0 for a clean end), false
// when the client stopped after "messages" replies.
//
// The client exits at the end of stdin.
package main

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

type call struct {
	Method       string            `json:"method"`
	Request      string            `json:"request"`
	TimeoutMs    int               `json:"timeout_ms"`
	Copies       int               `json:"copies"`
	MaxRecv      int               `json:"max_recv"`
	WaitForReady bool              `json:"wait_for_ready"`
	Metadata     map[string]string `json:"metadata"`
	Messages     int               `json:"messages"`
}

type result struct {
	Call      int      `json:"call"`
	Copy      int      `json:"copy"`
	Reply     string   `json:"reply"`
	Code      uint32   `json:"code"`
	Message   string   `json:"message"`
	ElapsedMs float64  `json:"elapsed_ms"`
	Replies   []string `json:"replies,omitempty"`
	Ended     bool     `json:"ended"`
}

// rawCodec sends and receives messages as they are: []byte in, *[]byte out.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) {
	b, ok := v.([]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
	}
	return b, nil
}

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	p, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*p = append([]byte(nil), data...)
	return nil
}

// Name is the proto codec's: registered in init, the raw codec serves every call as the
// default codec, without a content-subtype.
func (rawCodec) Name() string { return "proto" }

func init() { encoding.RegisterCodec(rawCodec{}) }

// callContext is the call's deadline and metadata; callOptions its limits.
func callContext(c call) (context.Context, context.CancelFunc) {
	timeout := time.Duration(c.TimeoutMs) * time.Millisecond
	if c.TimeoutMs <= 0 {
		timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	for key, value := range c.Metadata {
		ctx = metadata.AppendToOutgoingContext(ctx, key, value)
	}
	return ctx, cancel
}

func callOptions(c call) []grpc.CallOption {
	options := []grpc.CallOption{grpc.WaitForReady(c.WaitForReady)}
	if c.MaxRecv > 0 {
		options = append(options, grpc.MaxCallRecvMsgSize(c.MaxRecv))
	}
	return options
}

func invoke(conn *grpc.ClientConn, c call, request []byte) (reply []byte, err error) {
	ctx, cancel := callContext(c)
	defer cancel()
	err = conn.Invoke(ctx, c.Method, request, &reply, callOptions(c)...)
	return reply, err
}

// watch makes a server-streaming call: its replies, whether the server ended it, and how.
func watch(conn *grpc.ClientConn, c call, request []byte) (replies [][]byte, ended bool, err error) {
	ctx, cancel := callContext(c)
	defer cancel() // after c.Messages replies: the client cancels, as the kubelet does
	desc := &grpc.StreamDesc{ServerStreams: true}
	stream, err := conn.NewStream(ctx, desc, c.Method, callOptions(c)...)
	if err != nil {
		return nil, true, err
	}
	if err := stream.SendMsg(request); err != nil {
		return nil, true, err
	}
	if err := stream.CloseSend(); err != nil {
		return nil, true, err
	}
	for len(replies) < c.Messages {
		var reply []byte
		if err := stream.RecvMsg(&reply); err == io.EOF {
			return replies, true, nil
		} else if err != nil {
			return replies, true, err
		}
		replies = append(replies, reply)
	}
	return replies, false, nil
}

func copies(c call) int {
	if c.Copies < 1 {
		return 1
	}
	return c.Copies
}

// runBatch makes the calls of one batch, all at once; their results in input order.
func runBatch(conn *grpc.ClientConn, calls []call) []result {
	total := 0
	for _, c := range calls {
		total += copies(c)
	}
	results := make([]result, 0, total) // never grows: each invocation fills its own entry
	var running sync.WaitGroup
	for i, c := range calls {
		request, err := hex.DecodeString(c.Request)
		if err != nil {
			fail("call %d: request is not hex: %v", i, err)
		}
		for k := 0; k < copies(c); k++ {
			results = append(results, result{Call: i, Copy: k})
			running.Add(1)
			go func(r *result, c call) {
				defer running.Done()
				start := time.Now()
				var err error
				if c.Messages > 0 {
					var replies [][]byte
					replies, r.Ended, err = watch(conn, c, request)
					r.Replies = make([]string, len(replies))
					for i, reply := range replies {
						r.Replies[i] = hex.EncodeToString(reply)
					}
				} else {
					var reply []byte
					reply, err = invoke(conn, c, request)
					r.Reply = hex.EncodeToString(reply)
				}
				r.ElapsedMs = float64(time.Since(start).Microseconds()) / 1000
				s := status.Convert(err)
				r.Code, r.Message = uint32(s.Code()), s.Message()
			}(&results[len(results)-1], c)
		}
	}
	running.Wait()
	return results
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "grpc_client: "+format+"\n", args...)
	os.Exit(2)
}

func main() {
	if len(os.Args) != 2 {
		fail("usage: grpc_client unix:///path/to/socket | /path/to/socket")
	}
	options := []grpc.DialOption{grpc.WithInsecure()}
	if !strings.HasPrefix(os.Args[1], "unix:") {
		options = append(options, grpc.WithContextDialer(
			func(ctx context.Context, path string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", path)
			}))
	}
	conn, err := grpc.Dial(os.Args[1], options...)
	if err != nil {
		fail("cannot dial %s: %v", os.Args[1], err)
	}
	defer conn.Close()

	in := bufio.NewReader(os.Stdin)
	out := json.NewEncoder(os.Stdout)
	for {
		line, err := in.ReadBytes('\n')
		if err == io.EOF && len(line) == 0 {
			return
		} else if err != nil && err != io.EOF {
			fail("cannot read stdin: %v", err)
		}
		var calls []call
		if err := json.Unmarshal(line, &calls); err != nil {
			fail("a batch is not a JSON list of calls: %v", err)
		}
		for _, r := range runBatch(conn, calls) {
			if err := out.Encode(r); err != nil {
				fail("cannot write a result: %v", err)
			}
		}
	}
}
