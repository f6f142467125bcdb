"""Lua scripts that answer queries on the Redis prefix index (pure text; run by :mod:`redis_index`).

Same conventions as :mod:`balancer.index.redis_lua` (``KEYS[1]`` routes, ``ARGV[1]`` is the prefix).
``MATCH`` first expires due speculative entries, so that ``stats`` afterwards agrees with the
in-memory table; it writes nothing else.
"""

from __future__ import annotations

from balancer.index.redis_lua import PRELUDE

_MATCH_BODY = """
-- ARGV: prefix, now, n_among (-1: every replica), among..., keys...
-- returns {replicas asked when n_among = -1, {holder field, depth, ...}}
local NOW, NA = ARGV[2], tonumber(ARGV[3])
expire(NOW)
finish()
local asked, listed = {}, {}
if NA < 0 then
  listed = call('SMEMBERS', REPLICAS)
  for _, r in ipairs(listed) do asked[r] = true end
else
  for j = 4, 3 + NA do asked[ARGV[j]] = true end
end
local first = 4 + math.max(NA, 0)
local alive, out, depth = {}, {}, 0
for i = first, #ARGV do
  local bk = P .. 'b:' .. ARGV[i]
  if i == first then
    local fv = call('HGETALL', bk)
    for j = 1, #fv, 2 do
      local r = string.match(fv[j], '^(.*)#[^#]*$')
      if r and asked[r] then alive[#alive + 1] = fv[j] end
    end
  else
    local vals = hmget(bk, alive)
    local still = {}
    for j, f in ipairs(alive) do
      if vals[j] then
        still[#still + 1] = f
      else
        out[#out + 1] = f
        out[#out + 1] = depth
      end
    end
    alive = still
  end
  if #alive == 0 then break end
  depth = depth + 1
end
for _, f in ipairs(alive) do
  out[#out + 1] = f
  out[#out + 1] = depth
end
return {listed, out}
"""

_STATS_BODY = """
-- ARGV: prefix; returns {unique blocks, {cache id, held, ...}, speculative entries}
local spec = 0
for _, r in ipairs(call('SMEMBERS', SPECSET)) do
  spec = spec + call('ZCARD', P .. 's:' .. r)
end
return {call('ZCARD', LRU), call('HGETALL', HELD), spec}
"""

MATCH = PRELUDE + _MATCH_BODY
"""Expire due speculative entries, then walk the request's keys and report each holder's depth."""
STATS = PRELUDE + _STATS_BODY
"""Sizes: unique blocks, per-cache held counts, live speculative entries."""
