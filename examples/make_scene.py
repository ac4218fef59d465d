"""Make the small scene examples/render.toml renders: a turning monkey head on a floor,
lit by the sun, seen by one camera; Cycles, 48 frames, 320x240, 16 samples.

    python examples/make_scene.py examples/scene.blend

Needs the bpy package (pip install 'gpumarket[render]'). With --marker PATH the scene also
carries a text block registered to run on load that would create PATH: the tests use it to
check that a provider never runs a scene's scripts.
"""

from __future__ import annotations

import argparse
import math


def make(path: str, frames: int, marker: str | None) -> None:
    import bpy

    bpy.ops.wm.read_factory_settings(use_empty=True)
    scene = bpy.context.scene
    bpy.ops.mesh.primitive_monkey_add(location=(0, 0, 0))
    head = bpy.context.object
    bpy.ops.object.shade_smooth()
    paint = bpy.data.materials.new("paint")
    paint.diffuse_color = (0.8, 0.3, 0.1, 1.0)
    head.data.materials.append(paint)
    bpy.ops.mesh.primitive_plane_add(size=10, location=(0, 0, -1))
    bpy.ops.object.light_add(type="SUN", location=(3, -3, 5))
    bpy.context.object.data.energy = 3.0
    bpy.ops.object.camera_add(location=(0, -5, 1.5), rotation=(math.radians(80), 0, 0))
    scene.camera = bpy.context.object
    head.rotation_euler = (0, 0, 0)
    head.keyframe_insert("rotation_euler", frame=1)
    head.rotation_euler = (0, 0, math.radians(360))
    head.keyframe_insert("rotation_euler", frame=frames + 1)
    scene.frame_start, scene.frame_end = 1, frames
    scene.render.engine = "CYCLES"
    scene.cycles.samples = 16
    scene.render.resolution_x, scene.render.resolution_y = 320, 240
    if marker:
        text = bpy.data.texts.new("on_load.py")
        text.write(f"open({marker!r}, 'w').write('a scene script ran')\n")
        text.use_module = True   # Blender runs it on load when scripts may auto-run
    bpy.ops.wm.save_as_mainfile(filepath=path, compress=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the .blend file to write")
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--marker", help="add an auto-run script that would create this file")
    args = parser.parse_args()
    make(args.path, args.frames, args.marker)


if __name__ == "__main__":
    main()
