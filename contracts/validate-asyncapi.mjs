// Validates AsyncAPI documents with @asyncapi/parser, the parser and Spectral ruleset `asyncapi validate` runs:
// `node validate-asyncapi.mjs FILE...` prints one JSON line per file ({file, valid, problems}) and exits 1 when a
// file has an error or a warning (hints and information, such as "a newer AsyncAPI version exists", pass).
import { readFileSync } from 'node:fs';
import { Parser } from '@asyncapi/parser';

const ERROR = 0;
const WARNING = 1;
const parser = new Parser();
let failed = false;
for (const file of process.argv.slice(2)) {
  const diagnostics = await parser.validate(readFileSync(file, 'utf8'), { source: file });
  const problems = diagnostics
    .filter((d) => d.severity === ERROR || d.severity === WARNING)
    .map((d) => ({ severity: d.severity === ERROR ? 'error' : 'warning', code: d.code, message: d.message,
                   path: d.path.join('.') }));
  failed ||= problems.length > 0;
  console.log(JSON.stringify({ file, valid: problems.length === 0, problems }));
}
process.exit(failed ? 1 : 0);
