//! Redis Stream replies, parsed: what the block events' follower and the KV event stream's
//! consumers and publisher read (`XREAD`, `XRANGE`, `XREVRANGE`).

use redis::Value;

/// A stream entry: its id and its fields.
pub type Entry = (String, Vec<(Vec<u8>, Vec<u8>)>);

/// `XREAD` reply (RESP2 arrays or RESP3 maps) → entries of the one stream read.
pub fn parse_xread(v: Value) -> Vec<Entry> {
    let streams: Vec<Value> = match v {
        Value::Array(a) => a,
        Value::Map(m) => m
            .into_iter()
            .map(|(k, v)| Value::Array(vec![k, v]))
            .collect(),
        _ => return vec![],
    };
    let mut out = Vec::new();
    for s in streams {
        let Value::Array(mut kv) = s else { continue };
        if kv.len() != 2 {
            continue;
        }
        let Value::Array(items) = kv.pop().expect("two") else {
            continue;
        };
        out.extend(parse_entries(items));
    }
    out
}

/// A stream's entries (`XRANGE`, `XREVRANGE`, one stream of `XREAD`) → (id, fields).
pub fn parse_entries(items: Vec<Value>) -> Vec<Entry> {
    let mut out = Vec::new();
    for item in items {
        let Value::Array(mut pair) = item else {
            continue;
        };
        if pair.len() != 2 {
            continue;
        }
        let fields = pair.pop().expect("two");
        let id = match pair.pop().expect("two") {
            Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
            Value::SimpleString(s) => s,
            _ => continue,
        };
        let flat: Vec<Vec<u8>> = match fields {
            Value::Array(f) => f
                .into_iter()
                .filter_map(|x| match x {
                    Value::BulkString(b) => Some(b),
                    Value::SimpleString(s) => Some(s.into_bytes()),
                    _ => None,
                })
                .collect(),
            _ => continue,
        };
        let pairs = flat
            .chunks_exact(2)
            .map(|c| (c[0].clone(), c[1].clone()))
            .collect();
        out.push((id, pairs));
    }
    out
}
