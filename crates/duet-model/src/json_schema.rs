//! Where duet's JSON Schema constraints depart from plain JSON Schema, in one place (the
//! router's check and the workers' grammar compile every schema through [`with_defaults`]):
//!
//! - **Compact separators.** The JSON is generated without whitespace between its tokens
//!   (`{"a":1,"b":[2,3]}`). llguidance's default allows any whitespace anywhere, which lets a
//!   small model fill its budget with blank lines. A schema that carries llguidance's own
//!   options (`"x-guidance": {"whitespace_flexible": true}`, or any other `x-guidance` object)
//!   keeps them.
//! - **Bounded numbers.** An `integer` or `number` with no `minimum` (`exclusiveMinimum`) or
//!   `maximum` (`exclusiveMaximum`) gets ±[`NUMBER_BOUND`], what both a 64-bit integer and a
//!   double hold, so that a model cannot write digits forever. Bounds the schema gives are
//!   kept. A `number`'s fraction digits are not bounded (JSON Schema has no way to say so):
//!   `max_tokens` ends such an answer, with `finish_reason: "length"`.
//! - **Closed objects**, where asked for ([`close_objects`]: tool arguments and `strict`
//!   response formats, as OpenAI's strict mode and vLLM's `disable-additional-properties` do):
//!   an object schema that lists properties and says nothing of `additionalProperties` gets
//!   `"additionalProperties": false`.
//!
//! Property order follows the schema's `properties` (llguidance writes them in that order), and
//! keywords llguidance does not implement are refused by name when the schema compiles.

use serde_json::{Map, Value};

/// The key of llguidance's options inside a schema.
pub const OPTIONS_KEY: &str = "x-guidance";

/// The largest magnitude an unbounded `integer` or `number` may take: 2^63 − 1024, the largest
/// double below 2^63, so a 64-bit integer holds it too. (llguidance reads bounds as doubles, and
/// 2^63 itself is past `i64`, which its digit arithmetic uses.)
pub const NUMBER_BOUND: i64 = 9_223_372_036_854_774_784;

/// `schema` with duet's defaults (see the module): compact separators unless the schema sets
/// llguidance's options itself, and bounds on unbounded numbers. A schema that is not an object
/// (`true`, `false`) is returned as it is.
pub fn with_defaults(mut schema: Value) -> Value {
    walk(&mut schema, &mut bound_numbers);
    if let Value::Object(top) = &mut schema {
        top.entry(OPTIONS_KEY)
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// Lets the JSON of `schema` have any whitespace between its tokens (llguidance's default), as
/// the request's `whitespace_flexible` asks.
pub fn flexible_whitespace(schema: &mut Value) {
    if let Value::Object(top) = schema {
        let options = top
            .entry(OPTIONS_KEY)
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(options) = options {
            options.insert("whitespace_flexible".into(), Value::Bool(true));
        }
    }
}

/// Closes every object of `schema` that lists `properties` (or `patternProperties`) and says
/// nothing of `additionalProperties`: only the listed properties may appear.
pub fn close_objects(schema: &mut Value) {
    walk(schema, &mut |node| {
        if (node.contains_key("properties") || node.contains_key("patternProperties"))
            && !node.contains_key("additionalProperties")
        {
            node.insert("additionalProperties".into(), Value::Bool(false));
        }
    });
}

/// Adds the default bounds to an `integer` or `number` schema without them.
fn bound_numbers(node: &mut Map<String, Value>) {
    let types: Vec<&str> = match node.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => return,
    };
    if !types.iter().any(|t| *t == "integer" || *t == "number") {
        return;
    }
    if !node.contains_key("minimum") && !node.contains_key("exclusiveMinimum") {
        node.insert("minimum".into(), Value::from(-NUMBER_BOUND));
    }
    if !node.contains_key("maximum") && !node.contains_key("exclusiveMaximum") {
        node.insert("maximum".into(), Value::from(NUMBER_BOUND));
    }
}

/// Calls `visit` on every schema object of `schema`: itself and each subschema, wherever JSON
/// Schema places one (never a `properties` map or an `enum` value as if it were a schema).
fn walk(schema: &mut Value, visit: &mut impl FnMut(&mut Map<String, Value>)) {
    let Value::Object(node) = schema else {
        return;
    };
    visit(node);
    for (key, value) in node.iter_mut() {
        match key.as_str() {
            // Maps of names to schemas.
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Value::Object(map) = value {
                    for sub in map.values_mut() {
                        walk(sub, &mut *visit);
                    }
                }
            }
            // Lists of schemas.
            "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                if let Value::Array(list) = value {
                    for sub in list {
                        walk(sub, &mut *visit);
                    }
                }
            }
            // One schema (`items` may also be a list, in older drafts).
            "items"
            | "additionalItems"
            | "additionalProperties"
            | "not"
            | "contains"
            | "propertyNames"
            | "if"
            | "then"
            | "else"
            | "unevaluatedItems"
            | "unevaluatedProperties" => match value {
                Value::Array(list) => {
                    for sub in list {
                        walk(sub, &mut *visit);
                    }
                }
                sub => walk(sub, &mut *visit),
            },
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::Grammar;
    use crate::params::Constraint;

    /// The tiny tokenizer's single bytes are ids 3 + byte; `</s>` (2) ends the answer.
    fn compile(schema: &Value) -> Grammar {
        let (compiler, _) = crate::grammar::tests::compiler();
        compiler
            .compile(&Constraint::JsonSchema(schema.to_string()))
            .unwrap()
    }

    fn allowed(g: &mut Grammar, b: u8) -> bool {
        let mut logits = vec![0.0f32; 384];
        g.mask(&mut logits);
        logits[3 + b as usize].is_finite()
    }

    /// Feeds `text`, each byte of which the grammar must allow.
    fn feed(g: &mut Grammar, text: &str) {
        for b in text.bytes() {
            assert!(allowed(g, b), "{:?} refused in {text:?}", b as char);
            g.accept(3 + b as u32);
        }
    }

    /// No whitespace between tokens by default; a schema asking for llguidance's flexible
    /// whitespace gets it.
    #[test]
    fn json_is_compact_unless_the_schema_asks_for_whitespace() {
        let mut schema = serde_json::json!({"type": "object", "properties": {
            "a": {"type": "array", "items": {"type": "integer"}}}, "required": ["a"]});
        let mut g = compile(&schema);
        for b in [b' ', b'\n'] {
            assert!(!allowed(&mut g, b), "{:?} before the object", b as char);
        }
        feed(&mut g, "{\"a\":[1");
        for b in [b' ', b'\n', b'\t'] {
            assert!(!allowed(&mut g, b), "{:?} inside the array", b as char);
        }
        feed(&mut g, ",2]}");
        assert!(g.is_complete());
        flexible_whitespace(&mut schema);
        let mut g = compile(&schema);
        feed(&mut g, "{ \"a\" :\n [1 , 2] }");
    }

    /// A number without bounds holds at most what a 64-bit integer and a double do (no
    /// endless run of digits before the point); one with bounds keeps them.
    #[test]
    fn unbounded_numbers_stop_at_the_64_bit_range() {
        for schema in [
            serde_json::json!({"type": "integer", "minimum": 0}),
            serde_json::json!({"type": "number"}),
        ] {
            let mut g = compile(&schema);
            feed(&mut g, "9223372036854774000");
            assert!(
                !(b'0'..=b'9').any(|d| allowed(&mut g, d)),
                "{schema}: a 20th digit"
            );
        }
        let mut g = compile(&serde_json::json!({"type": "integer", "minimum": 0}));
        feed(&mut g, "922337203685477478");
        assert!(!allowed(&mut g, b'5') && allowed(&mut g, b'4'));
        let mut g = compile(&serde_json::json!({"type": "integer"}));
        feed(&mut g, "-9223372036854774784");
        assert!(g.is_complete() || !allowed(&mut g, b'0'));
        let mut g = compile(&serde_json::json!({"type": "integer", "minimum": 0,
                                                "maximum": 99}));
        feed(&mut g, "99");
        assert!(!allowed(&mut g, b'0'));
        let schema = with_defaults(serde_json::json!({"type": ["number", "null"],
                                                      "exclusiveMinimum": 0}));
        assert_eq!(schema["maximum"], NUMBER_BOUND);
        assert!(schema.get("minimum").is_none());
    }

    /// Closed objects: every object that lists its properties, however deep, and not the
    /// `properties` maps themselves (a property may be called `properties`) or objects that
    /// say what else they allow.
    #[test]
    fn close_objects_closes_every_listed_object_only() {
        let mut schema = serde_json::json!({
            "type": "object",
            "properties": {
                "properties": {"type": "object", "properties": {"x": {"type": "string"}}},
                "free": {"type": "object", "additionalProperties": {"type": "integer"}},
                "list": {"type": "array", "items": {"properties": {"y": {}}}}
            },
            "$defs": {"d": {"properties": {"z": {}}}},
            "anyOf": [{"properties": {"w": {}}}, true]
        });
        close_objects(&mut schema);
        assert_eq!(schema["additionalProperties"], false);
        let p = &schema["properties"];
        assert_eq!(p["properties"]["additionalProperties"], false);
        assert!(
            p["properties"]["properties"]
                .get("additionalProperties")
                .is_none()
        );
        assert_eq!(p["free"]["additionalProperties"]["type"], "integer");
        assert_eq!(p["list"]["items"]["additionalProperties"], false);
        assert_eq!(schema["$defs"]["d"]["additionalProperties"], false);
        assert_eq!(schema["anyOf"][0]["additionalProperties"], false);
        // Only the listed property may follow.
        let mut schema = serde_json::json!({"type": "object",
            "properties": {"city": {"type": "string"}}});
        let mut open = compile(&schema);
        feed(&mut open, "{\"city\":\"x\"");
        assert!(allowed(&mut open, b','), "plain JSON Schema allows more");
        close_objects(&mut schema);
        let mut closed = compile(&schema);
        feed(&mut closed, "{\"city\":\"x\"");
        assert!(!allowed(&mut closed, b','));
        feed(&mut closed, "}");
        assert!(closed.is_complete());
    }
}
