// One chat completion and one streamed one through the official openai npm package, printed
// as one JSON line, so tests/integration/test_clients.py can check what a JavaScript client
// gets from loragate: the text, the model name the answer carries, and the usage.
//
//   node tests/js/chat.mjs BASE_URL API_KEY MODEL [PROMPT]
//   node tests/js/chat.mjs http://127.0.0.1:8000/v1 unused fox "Hello there"
import OpenAI from "openai";

const [baseURL, apiKey, model, prompt = "Hello there"] = process.argv.slice(2);
if (!baseURL || !apiKey || !model) {
  console.error("usage: node chat.mjs BASE_URL API_KEY MODEL [PROMPT]");
  process.exit(2);
}

// No retries: a test must see the first answer, not one that a retry papered over.
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120_000 });
const request = {
  model,
  messages: [{ role: "user", content: prompt }],
  max_tokens: 16,
  temperature: 0,
};

const reply = await client.chat.completions.create(request);

const stream = await client.chat.completions.create({
  ...request,
  stream: true,
  stream_options: { include_usage: true },
});
const pieces = [];
const streamModels = new Set();
let streamUsage = null;
for await (const chunk of stream) {
  streamModels.add(chunk.model);
  if (chunk.usage) streamUsage = chunk.usage;
  for (const choice of chunk.choices) pieces.push(choice.delta?.content ?? "");
}

console.log(
  JSON.stringify({
    chat: {
      model: reply.model,
      content: reply.choices[0].message.content,
      finish_reason: reply.choices[0].finish_reason,
      usage: reply.usage,
    },
    stream: { models: [...streamModels], content: pieces.join(""), usage: streamUsage },
  }),
);
